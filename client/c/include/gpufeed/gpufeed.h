/* gpufeed C ABI: opaque handles, a status code plus a thread-local message.
 *
 * Every function that can fail returns a gpufeed_status (the canonical gRPC codes); on
 * failure gpufeed_last_error() returns a message for the calling thread, valid until that
 * thread's next call. Outputs come last, through out_* pointers. The Python package calls
 * this through ctypes: plain C types, no callbacks, no structs passed by value.
 *
 * Compatibility: within one GPUFEED_API_VERSION, functions, option keys and enum values are
 * only ever added, and the structs below never change (a caller built against an older
 * header passes a smaller one): an output added later comes as a function of its own
 * (gpufeed_position_samples, gpufeed_session_batch_size, gpufeed_batch_after), an input as an
 * option key. A caller that needs an addition checks for the function (dlsym) or the key
 * (INVALID_ARGUMENT "unknown ... option"); GPUFEED_API_VERSION changes only when something is
 * removed or changes meaning.
 */
#ifndef GPUFEED_GPUFEED_H_
#define GPUFEED_GPUFEED_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GPUFEED_API_VERSION 1

typedef enum gpufeed_status {
  GPUFEED_OK = 0,
  GPUFEED_CANCELLED = 1,
  GPUFEED_UNKNOWN = 2,
  GPUFEED_INVALID_ARGUMENT = 3,
  GPUFEED_DEADLINE_EXCEEDED = 4,
  GPUFEED_NOT_FOUND = 5,
  GPUFEED_ALREADY_EXISTS = 6,
  GPUFEED_PERMISSION_DENIED = 7,
  GPUFEED_RESOURCE_EXHAUSTED = 8,
  GPUFEED_FAILED_PRECONDITION = 9,
  GPUFEED_ABORTED = 10,
  GPUFEED_OUT_OF_RANGE = 11, /* end of data (stop_epoch reached) */
  GPUFEED_UNIMPLEMENTED = 12,
  GPUFEED_INTERNAL = 13,
  GPUFEED_UNAVAILABLE = 14,
  GPUFEED_DATA_LOSS = 15,
  GPUFEED_UNAUTHENTICATED = 16
} gpufeed_status;

/* Element types; the same numbers as gpufeed.v1.DType. */
typedef enum gpufeed_dtype {
  GPUFEED_DTYPE_BOOL = 1,
  GPUFEED_DTYPE_INT8 = 2,
  GPUFEED_DTYPE_UINT8 = 3,
  GPUFEED_DTYPE_INT16 = 4,
  GPUFEED_DTYPE_UINT16 = 5,
  GPUFEED_DTYPE_INT32 = 6,
  GPUFEED_DTYPE_UINT32 = 7,
  GPUFEED_DTYPE_INT64 = 8,
  GPUFEED_DTYPE_UINT64 = 9,
  GPUFEED_DTYPE_FLOAT16 = 10,
  GPUFEED_DTYPE_BFLOAT16 = 11,
  GPUFEED_DTYPE_FLOAT32 = 12,
  GPUFEED_DTYPE_FLOAT64 = 13,
  GPUFEED_DTYPE_COMPLEX64 = 14,
  GPUFEED_DTYPE_COMPLEX128 = 15
} gpufeed_dtype;

/* DLPack device types, for tensor.device_type. */
#define GPUFEED_DEVICE_CPU 1
#define GPUFEED_DEVICE_CUDA 2

typedef struct gpufeed_options gpufeed_options;
typedef struct gpufeed_session gpufeed_session;
typedef struct gpufeed_batch gpufeed_batch;

typedef struct gpufeed_session_info {
  uint64_t session_id;
  int64_t num_samples;
  int64_t steps_per_epoch; /* of a whole epoch; the samples served: gpufeed_session_batch_size */
  int32_t ring_slots;
  int32_t num_tensors;
} gpufeed_session_info;

typedef struct gpufeed_batch_info {
  int64_t epoch;
  int64_t step;
  int64_t batch_size;
  int64_t valid_count; /* rows [0, valid_count) are real; the rest pad the epoch */
  const int64_t* ids;  /* batch_size sample ids; valid while the batch handle lives */
  int32_t num_tensors;
  int32_t slot;
  uint64_t generation;
} gpufeed_batch_info;

/* One thing Attach reported about the dataset (the C++ client's DatasetNotice): samples left
 * out at open under `reason` ("no_image", "other_image_type", "link"; also counted in the
 * feed's bad samples) or a "warning" (count 0). Strings are owned by the session, valid
 * until gpufeed_session_destroy. */
typedef struct gpufeed_notice {
  const char* reason;
  int64_t count;
  const char* example; /* the first of them, as the message names it */
  const char* message; /* one line: what, how many, the first, and what to do */
} gpufeed_notice;

typedef struct gpufeed_tensor {
  const char* name;     /* valid while the batch handle lives */
  int32_t dtype;        /* gpufeed_dtype */
  int32_t ndim;
  const int64_t* shape; /* ndim entries, first is batch_size */
  void* data;           /* host: mapped staging memory; device: a device pointer */
  uint64_t byte_size;
  int32_t device_type;  /* GPUFEED_DEVICE_CPU or GPUFEED_DEVICE_CUDA */
  int32_t device_id;
} gpufeed_tensor;

/* GPUFEED_API_VERSION of the loaded library. */
uint32_t gpufeed_api_version(void);
/* The calling thread's message for its last failed call ("" if none). */
const char* gpufeed_last_error(void);
/* The socket used when the option "socket" is not set: /run/gpufeed/gpufeed.sock if it exists,
 * else $XDG_RUNTIME_DIR/gpufeed/gpufeed.sock if that exists (a gpufeedd run without root),
 * else /run/gpufeed/gpufeed.sock. Valid until the calling thread's next call of it. */
const char* gpufeed_default_socket(void);

/* Attach options, by key. Keys: socket (default: gpufeed_default_socket()), job, kind, dataset,
 * token_dtype, delivery ("host" or "device"), gpu ("" = current device, "cuda:N" or a "GPU-..."
 * UUID), ipc ("auto", "vmm", "legacy"), pipeline_json, bad_sample ("skip", "fail"), decode ("auto",
 * "cpu", "nvjpeg") and augment ("auto", "cpu", "gpu") for image datasets, start_fingerprint (from
 * gpufeed_fingerprint of the run that saved start_epoch/start_step: a different feed is then
 * refused with FAILED_PRECONDITION naming the fields that differ), share_group (image datasets:
 * the jobs of one group read one order and decode each sample once), elastic (what a start
 * saved at another world size keeps: "global_batch", the default, each rank then getting the
 * saved global batch / world_size, or "rank_batch", batch_size per rank; see
 * gpufeed_session_batch_size), pack (kind tokens: "none", the default, "concat" or "best_fit":
 * documents packed into rows, with position_ids, loss_mask and cu_seqlens beside tokens),
 * blend_history_json (a resumed blend's segments, as gpufeed_session_blend_segments_json
 * gave them at the run that saved the position; refused at once when not such JSON) (strings);
 * rank, world_size, seq_len, vocab_size, batch_size, seed, shuffle, drop_last, even, ring_slots,
 * start_epoch, start_step, start_samples (the global cursor of the saved position, from
 * gpufeed_position_samples; 0: start_step x the saved global batch), stop_epoch, rpc_timeout_ms,
 * reconnect_timeout_ms (how long gpufeed_next re-attaches after the daemon went away, default
 * 120000, 0 = never), keepalive_ms (pings that find a daemon that stopped answering, default 10000,
 * 0 = none, else >= 1000), eos_id (with a pack mode: documents end at this token; unset: a Megatron
 * .bin's .idx documents), pack_lookahead (pack "best_fit": documents packed together, at most; 0 =
 * the daemon's default) (integers; see the C++ AttachOptions). An unknown key is INVALID_ARGUMENT.
 */
gpufeed_status gpufeed_options_create(gpufeed_options** out_options);
void gpufeed_options_destroy(gpufeed_options* options);
gpufeed_status gpufeed_options_set_string(gpufeed_options* options, const char* key,
                                          const char* value);
gpufeed_status gpufeed_options_set_int(gpufeed_options* options, const char* key, int64_t value);
/* kind "records": appends an array (a tensor `name` from the .npy `file`), in order; see the
 * C++ AttachOptions::arrays: `file` is a name in the directory set as "dataset", or, with no
 * dataset set, an absolute path, every array's in one directory. Checked at gpufeed_attach. */
gpufeed_status gpufeed_options_add_array(gpufeed_options* options, const char* name,
                                         const char* file);
/* kinds "tokens" and "webdataset": appends a shard file (an absolute path) to an explicit
 * list, read in the order added, instead of "dataset"; see the C++
 * AttachOptions::dataset_paths. Checked at gpufeed_attach. */
gpufeed_status gpufeed_options_add_dataset_path(gpufeed_options* options, const char* path);
/* kind "tokens": appends a source to a weighted blend, instead of "dataset": `name` is the
 * absolute path of a token file, a directory of them or a glob in the last component
 * (/data/code/shard_*.bin), expanded to its files at gpufeed_attach; `weight` > 0 and finite
 * (INVALID_ARGUMENT naming the source otherwise). See the C++ AttachOptions::blend. */
gpufeed_status gpufeed_options_add_blend_source(gpufeed_options* options, const char* name,
                                                double weight);

gpufeed_status gpufeed_attach(const gpufeed_options* options, gpufeed_session** out_session);
gpufeed_status gpufeed_session_get_info(const gpufeed_session* session,
                                        gpufeed_session_info* out_info);
/* The next batch; timeout_ms < 0 waits forever. OUT_OF_RANGE at the end of data. */
gpufeed_status gpufeed_next(gpufeed_session* session, int64_t timeout_ms,
                            gpufeed_batch** out_batch);
/* The position after the last batch gpufeed_next returned: what to checkpoint (with
 * gpufeed_position_samples and gpufeed_fingerprint). */
gpufeed_status gpufeed_position(const gpufeed_session* session, int64_t* out_epoch,
                                int64_t* out_step);
/* That position's global cursor: the samples of its epoch the job's batches before it cover,
 * all ranks together, the same from every rank. Resume with it as start_samples (at any world
 * size: the option "elastic"). */
gpufeed_status gpufeed_position_samples(const gpufeed_session* session, int64_t* out_samples);
/* Samples per rank per step the session serves: the option batch_size, or at an elastic
 * resume that keeps the global batch, the saved global batch / world_size. */
gpufeed_status gpufeed_session_batch_size(const gpufeed_session* session,
                                          int64_t* out_batch_size);
/* The feed's fingerprint, to save beside the position: a NUL-terminated string owned by the
 * session, valid until gpufeed_session_destroy. */
gpufeed_status gpufeed_fingerprint(const gpufeed_session* session, const char** out_fingerprint);
/* A blend's segments, as JSON: [{"start": 0, "weights": [0.5, 0.3, 0.2], "ledger": [0, 0, 0]},
 * ...] ("[]": no blend). Save it beside the position; resume with it as the option
 * blend_history_json. As the daemon last reported them (a re-attach may): ask after the last
 * batch before the checkpoint. A NUL-terminated string owned by the session, valid until the
 * next call of this function on it or gpufeed_session_destroy. */
gpufeed_status gpufeed_session_blend_segments_json(gpufeed_session* session, const char** out_json);
/* Device delivery: whether the daemon's work on the session's GPU (*out_daemon) and this
 * process's (*out_consumer) go through MPS: 1 or 0, -1 when unknown (host delivery, no CUDA, an
 * old driver or daemon). The daemon's kernels run beside training's only when both are 1. */
gpufeed_status gpufeed_session_mps(const gpufeed_session* session, int32_t* out_daemon,
                                   int32_t* out_consumer);
/* The notices Attach reported (0 when nothing was left out), and notice `index` of them
 * (OUT_OF_RANGE outside [0, count)). A consumer should show each to its user. */
gpufeed_status gpufeed_session_notice_count(const gpufeed_session* session, int32_t* out_count);
gpufeed_status gpufeed_session_get_notice(const gpufeed_session* session, int32_t index,
                                          gpufeed_notice* out_notice);
gpufeed_status gpufeed_detach(gpufeed_session* session);
/* Detaches if needed and frees the handle. Batches still held stay valid memory. */
void gpufeed_session_destroy(gpufeed_session* session);

gpufeed_status gpufeed_batch_get_info(const gpufeed_batch* batch, gpufeed_batch_info* out_info);
gpufeed_status gpufeed_batch_get_tensor(const gpufeed_batch* batch, int32_t index,
                                        gpufeed_tensor* out_tensor);
/* The position after the batch: (epoch + 1, 0, 0) after an epoch's last batch, else (epoch,
 * step + 1, the global cursor). An epoch an elastic resume began mid-way may have another
 * number of steps than steps_per_epoch: go by this, not by counting. */
gpufeed_status gpufeed_batch_after(const gpufeed_batch* batch, int64_t* out_epoch,
                                   int64_t* out_step, int64_t* out_samples);
/* Device delivery: makes `stream` (a cudaStream_t; NULL: the legacy default stream) wait
 * until the batch is in device memory, without blocking the host. OK for host batches. */
gpufeed_status gpufeed_batch_wait_ready(const gpufeed_batch* batch, void* stream);
/* Returns the batch's slot to the daemon and frees the handle. Device delivery: the slot is
 * not written again before the work queued on the legacy default stream has completed. */
void gpufeed_batch_release(gpufeed_batch* batch);
/* As gpufeed_batch_release, ordered after the work queued on `stream` (a cudaStream_t). */
void gpufeed_batch_release_after(gpufeed_batch* batch, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* GPUFEED_GPUFEED_H_ */
