// The gpufeed C++ client. Free of gRPC and protobuf: link libgpufeed_client and include this.
//
//   gpufeed::client::AttachOptions options;
//   options.socket = "/run/gpufeed/gpufeed.sock";
//   options.job = "gpt"; options.rank = rank; options.world_size = world;
//   options.kind = "tokens"; options.dataset = "/data/train.bin";
//   options.token_dtype = "uint16"; options.seq_len = 1024; options.batch_size = 16;
//   auto session = gpufeed::client::Session::Attach(options);
//   while (true) {
//     absl::StatusOr<gpufeed::client::Batch> batch = (*session)->Next();
//     if (!batch.ok()) break;                 // OUT_OF_RANGE at the end of stop_epoch
//     const auto& tokens = batch->tensors()[0];  // [batch_size, seq_len + 1] in shared memory
//     ...
//   }  // each Batch returns its slot to the daemon when destroyed
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "gpufeed/dtype.h"

namespace gpufeed::client {

// The system daemon's socket (gpufeedd run as root, or by systemd, without --listen).
inline constexpr char kDefaultSocket[] = "/run/gpufeed/gpufeed.sock";

// The socket a client uses when none is given: kDefaultSocket if it exists, else
// $XDG_RUNTIME_DIR/gpufeed/gpufeed.sock if that exists (where a gpufeedd run without root
// listens), else kDefaultSocket. Looked up at each call.
std::string DefaultSocket();

// How an UNAVAILABLE message starts when no daemon listens at the socket tried (no socket
// file there, or a stale one): "no gpufeedd listening at SOCKET: WHY". Front ends add how to
// name another socket (gpufeedctl: --socket PATH; Python: socket=).
inline constexpr char kNoDaemonListening[] = "no gpufeedd listening at ";

// The socket's path from what a user may paste: gpufeedd logs its address as gRPC spells it,
// "unix:///run/gpufeed/gpufeed.sock" ("unix:PATH" too); those become the path; "" is
// DefaultSocket(). Anything else is returned as it is. Session::Attach, AdminClient::Connect,
// gpufeedctl and Python apply it.
std::string SocketPath(const std::string& given);

struct Position {
  int64_t epoch = 0;
  int64_t step = 0;
  // The feed the position belongs to (dataset identity and the settings that shape the
  // batches), from the daemon. Attaching with a start whose fingerprint is set resumes only
  // the same feed: a different one is FAILED_PRECONDITION naming each differing field. Its
  // world size and batch size are the layout the position was saved at: a start at another
  // one is an elastic resume (AttachOptions::elastic).
  std::string fingerprint;
  // The global cursor: the places of the epoch's order the job's batches before this
  // position cover, all ranks together (docs/sampling.md). The same from every rank of a
  // job, so one rank's position describes the whole job. Set in every position the daemon
  // reports; in a start, 0 means step x the saved global batch (a position saved before
  // this field). Last, so that {epoch, step, fingerprint} still initializes one.
  int64_t samples = 0;
};

// One source of a blend of token sources (AttachOptions::blend).
struct BlendSource {
  // An absolute path: a token file (a Megatron-LM X.bin is read with the X.idx beside it),
  // a directory (its regular files whose names do not start with '.', sorted by name), or a
  // glob in the last component (`/data/code/*.bin`: the names fnmatch matches, sorted). Of a
  // directory or a glob, an X.idx whose X.bin is among the files is no file of its own.
  // Session::Attach expands it to that list of files (their real paths), which the daemon
  // reads; the name itself labels the source in messages and metrics.
  std::string name;
  // > 0 and finite; normalised over the sources (w / sum w), as Megatron's normalize().
  double weight = 0;
};

// Where a blend's weights are in force (docs/howto/blends-and-packing.md): from blended
// sample `start` on, with `ledger` the samples each source gave before it. A blend's history
// is its segments in order: the first from 0, one more at each resume that changed weights.
struct BlendSegment {
  uint64_t start = 0;
  std::vector<double> weights;   // one a source, in AttachOptions::blend's order
  std::vector<uint64_t> ledger;  // one a source
  bool operator==(const BlendSegment& other) const {
    return start == other.start && weights == other.weights && ledger == other.ledger;
  }
};

// The segments as JSON, `[{"start": 0, "weights": [0.5, 0.3, 0.2], "ledger": [0, 0, 0]}]`,
// each weight written so that it reads back as the same double: what a checkpoint keeps.
std::string BlendSegmentsJson(const std::vector<BlendSegment>& segments);
// The segments from that JSON. INVALID_ARGUMENT naming the element ("blend_history[1].ledger:
// ...") when it is not a list of such objects, a start or count not an integer >= 0 (below
// 2^53), or a weight not finite or < 0.
absl::StatusOr<std::vector<BlendSegment>> ParseBlendSegmentsJson(std::string_view json);

struct AttachOptions {
  std::string socket;  // path of gpufeedd's Unix socket; "": DefaultSocket() at Attach
  std::string job = "default";
  int32_t rank = 0;
  int32_t world_size = 1;
  std::string kind = "tokens";  // tokens | records | image_folder | webdataset
  // Absolute path. Session::Attach opens it with this process's rights (a directory for
  // image_folder; for token or WebDataset shards the directory, or the directory of a glob
  // or brace pattern in the last component, `/data/train-{000..146}.tar`) and passes the
  // descriptor to gpufeedd, which reads through it only (docs/SECURITY.md section 2); the
  // path names the dataset in feeds and positions.
  std::string dataset;
  // records: several .npy arrays of one row count, one tensor each in this order, as
  // {name, file}: a file is a name directly in the directory `dataset`, or, with `dataset`
  // empty, an absolute path, every one in the same directory (which is then the dataset).
  // Sample i is row i of every array. Empty: `dataset` is one .npy file (tensor "data").
  std::vector<std::pair<std::string, std::string>> arrays;
  // tokens, webdataset: an explicit list of shard files (absolute paths), read in this order
  // (not sorted), instead of `dataset` (which stays empty). Session::Attach opens each with
  // this process's rights (refusing one it cannot read, naming it), then passes their deepest
  // common directory, beneath which gpufeedd opens them with this process's mode-bit rights
  // (docs/SECURITY.md section 2). At most 16384, no file twice. A Megatron-LM X.bin is read
  // with the X.idx beside it.
  std::vector<std::string> dataset_paths;
  // tokens: a weighted blend of token sources instead of `dataset` (which stays empty,
  // docs/howto/blends-and-packing.md): 1 to 256 sources, each expanded by Session::Attach
  // to its files (BlendSource::name; a source of no file is refused naming it). Each row
  // comes from one source, chosen by Megatron-Core's blending rule; each source keeps its
  // own shuffled order and cycles its own epochs. The files of every source lie beneath their
  // deepest common directory, which Attach opens and passes as it does dataset_paths'.
  std::vector<BlendSource> blend;
  // A resumed blend's history: SessionInfo::blend_segments (Session::blend_segments()) of
  // the run it resumes, kept with the position. Empty: a new blend. When the weights differ
  // from the last segment's, the daemon starts a new segment at the resume's position, so
  // that no sample of any source is repeated or skipped within that source's epoch.
  std::vector<BlendSegment> blend_history;
  // tokens: "none" (a row is one window of seq_len + 1 tokens), "concat" (Megatron's
  // concatenate-and-cut over the documents) or "best_fit" (whole documents packed into
  // rows best-fit-decreasing, cutting only documents longer than a row). A packed row comes
  // with `position_ids`, `loss_mask` and `cu_seqlens` beside `tokens`. With or without a
  // blend.
  std::string pack = "none";
  // Packing: a document ends at each token equal to eos_id (which it includes). Unset: a
  // Megatron .bin's .idx documents.
  std::optional<int64_t> eos_id;
  // pack "best_fit": documents packed together at most; 0: the daemon's default (1024).
  int64_t pack_lookahead = 0;
  // tokens: uint16 | uint32; empty: a .npy file's header says, a raw file is uint16.
  std::string token_dtype;
  // tokens: when > 0, Attach checks a sample of the file's tokens against it (a wrong
  // token_dtype shows as tokens beyond any vocabulary).
  int64_t vocab_size = 0;
  int64_t seq_len = 0;                 // tokens
  int64_t batch_size = 0;              // per rank
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = true;
  // With drop_last false: torch DistributedSampler's split, every rank the same count of
  // real samples per epoch (ceil(N / world_size); valid_count marks them).
  bool even = false;
  // Image datasets: a sharing group of this uid's jobs (docs/ARCHITECTURE.md section 9). The
  // group's name fixes the sample order (seed then keys only this job's augmentation), and the
  // group's jobs decode each sample once for all of them. Empty: none.
  std::string share_group;
  int32_t ring_slots = 0;        // 0: the daemon's default
  std::string delivery = "host";  // host | device
  // device delivery: "" (this process's current CUDA device), "cuda:N" or a "GPU-..." UUID.
  std::string gpu;
  // device delivery: "auto" (VMM fd where the GPU supports it), "vmm" or "legacy".
  std::string ipc = "auto";
  Position start;
  // What a start saved at another world size (or per-rank batch) keeps, start.fingerprint
  // naming the saved layout: "global_batch" (each rank gets the saved global batch /
  // world_size samples a step: batch_size must be that or the saved per-rank batch; the
  // global batches are the uninterrupted run's, byte for byte) or "rank_batch" (batch_size
  // per rank: the global batch changes, and the rest of the epoch is every sample not yet
  // delivered, each once). SessionInfo::batch_size says what the session serves.
  std::string elastic = "global_batch";
  int64_t stop_epoch = 0;  // exclusive; 0 = never end
  // Image datasets: the pipeline as JSON, {"ops": [{"random_resized_crop": {"size": 224}},
  // ...]} (deploy/pipelines/ has ImageNet's). Empty: none.
  std::string pipeline_json;
  std::string bad_sample = "skip";  // image datasets: skip (replace) or fail
  // Image datasets, device delivery: who decodes ("auto": nvJPEG where the daemon has it,
  // "cpu", "nvjpeg") and where the crop/resize/flip/normalize ops run ("auto": the GPU,
  // "cpu", "gpu"). Host delivery decodes and augments on the CPU.
  std::string decode = "auto";
  std::string augment = "auto";
  absl::Duration rpc_timeout = absl::Seconds(10);
  // When the stream or the connection fails with UNAVAILABLE (the daemon was killed, is
  // restarting, shutting down or draining), Next() re-attaches: same job, rank, feed, delivery
  // and ring slots, at the position of the next batch not yet returned, with its fingerprint,
  // retrying with backoff (50 ms doubling to 200 ms) for up to this long. The stream goes on with
  // no duplicate and no lost batch. Past it, UNAVAILABLE naming the socket and the wait.
  // Zero: no re-attach (the session's error is returned as it is).
  absl::Duration reconnect_timeout = absl::Seconds(120);
  // The connection pings the daemon this often when quiet; a ping unanswered for as long
  // again ends the stream with UNAVAILABLE, so a daemon that stops answering without closing
  // its socket (SIGSTOP, a frozen process or machine) is treated as gone: re-attached within
  // reconnect_timeout,
  // then an error. A Next() with no timeout therefore returns within about
  // 2 x keepalive + reconnect_timeout of the daemon's last answer. Zero or at least 1 s;
  // zero: no pings (such a Next() may then wait for ever).
  absl::Duration keepalive = absl::Seconds(10);
};

struct Tensor {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> shape;  // [batch_size, ...]
  const void* data = nullptr;  // in the session's mapped ring; valid while the Batch lives
  uint64_t byte_size = 0;
  int device = -1;  // CUDA device ordinal of `data` in this process; -1: host memory
};

namespace internal {
class SessionCore;
struct RingMapping;
}

// One batch, in place in the session's ring. Move-only; releases its slot to the daemon when
// destroyed (or on Release()). Its tensors must not be read after that.
class Batch {
 public:
  Batch() = default;
  Batch(Batch&& other) noexcept;
  Batch& operator=(Batch&& other) noexcept;
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;
  ~Batch();

  int64_t epoch() const { return epoch_; }
  int64_t step() const { return step_; }
  // The position after this batch (its fingerprint is the session's, left empty here):
  // (epoch + 1, 0, 0) after an epoch's last batch, else (epoch, step + 1, the global cursor).
  // After an elastic resume an epoch may have another number of steps than steps_per_epoch.
  const Position& after() const { return after_; }
  const std::vector<int64_t>& ids() const { return ids_; }
  // Rows [0, valid_count()) are real samples; the rest pad the last batch of an epoch.
  int64_t valid_count() const { return valid_; }
  std::vector<uint8_t> valid_mask() const;
  const std::vector<Tensor>& tensors() const { return tensors_; }
  // The tensor named `name`, or nullptr.
  const Tensor* tensor(const std::string& name) const;
  int32_t slot() const { return slot_; }
  uint64_t generation() const { return generation_; }
  // How long Next() waited for this batch: the data stall it reports with its release.
  absl::Duration waited() const { return waited_; }

  // Device delivery: makes `stream` (a cudaStream_t; nullptr: the legacy default stream)
  // wait until the batch is in device memory. No host synchronisation. OK for host batches.
  absl::Status WaitReady(void* stream = nullptr) const;

  // Returns the slot to the daemon now. Idempotent. For device delivery the daemon does not
  // write the slot again before the work queued on `stream` (a cudaStream_t; nullptr: the
  // legacy default stream) so far has completed.
  void Release(void* stream = nullptr);

 private:
  friend class internal::SessionCore;
  std::shared_ptr<internal::SessionCore> core_;
  // The mapping of the ring the batch lies in, and which attachment of the session it came
  // from (a re-attach maps a new ring; a batch of an earlier one keeps its own).
  std::shared_ptr<internal::RingMapping> ring_;
  uint64_t link_ = 0;
  int32_t slot_ = -1;
  uint64_t generation_ = 0;
  int64_t epoch_ = 0;
  int64_t step_ = 0;
  int64_t valid_ = 0;
  Position after_;
  absl::Duration waited_;
  std::vector<int64_t> ids_;
  std::vector<Tensor> tensors_;
};

// What Attach reported about the dataset as opened (so nothing is skipped silently):
// samples left out at open, by reason ("no_image": WebDataset keys without an image;
// "other_image_type", "link": image_folder files), also counted in FeedInfo::bad_samples, or
// a "warning" (count 0). gpufeedctl consume prints each; Python warns once (GpufeedWarning).
struct DatasetNotice {
  std::string reason;
  int64_t count = 0;
  std::string example;  // the first of them, as messages name it
  std::string message;  // one line: what, how many, the first, and what to do
};

struct SessionInfo {
  uint64_t session_id = 0;
  std::string feed_key;
  int64_t num_samples = 0;
  // Batches per rank in a whole epoch of the served layout (an epoch an elastic resume
  // began mid-way may have one step fewer: Batch::after() says where each ends).
  int64_t steps_per_epoch = 0;
  // Samples per rank per step this session serves: AttachOptions::batch_size, or at an
  // elastic resume that keeps the global batch, the saved global batch / world_size.
  int64_t batch_size = 0;
  int32_t ring_slots = 0;
  uint64_t slot_stride_bytes = 0;
  std::vector<Tensor> layout;  // data = nullptr; shapes and dtypes of every batch
  bool device = false;         // device delivery
  std::string gpu_uuid;        // device delivery
  int gpu_ordinal = -1;        // device delivery: the CUDA device in this process
  std::string ipc;             // device delivery: "vmm" or "legacy"
  std::string decode;          // image datasets: "cpu" or "nvjpeg", as the daemon resolved it
  std::string augment;         // image datasets: "cpu" or "gpu"
  // Device delivery: whether the daemon's work on the GPU, and this process's, go through
  // MPS. Only when both do are the daemon's kernels run beside training's instead of
  // time-sliced against them (README, "MPS"); -1: unknown (no CUDA, an old driver).
  int daemon_mps = -1;
  int consumer_mps = -1;
  std::vector<DatasetNotice> notices;  // none when nothing was left out
  // A blend: the segments in force (AttachOptions::blend_history, and one more where this
  // attach changed the weights), what a checkpoint keeps to resume it. Empty: no blend.
  std::vector<BlendSegment> blend_segments;
};

class Session {
 public:
  // Attaches, maps the ring (memory socket) and opens the stream. Errors carry the daemon's
  // code and message; UNAVAILABLE "no gpufeedd listening at SOCKET: ..." when no daemon
  // answers there.
  static absl::StatusOr<std::unique_ptr<Session>> Attach(const AttachOptions& options);
  // Detaches; while Batches of it are still held, when the last of them is released (a held
  // batch keeps its bytes; Detach() likewise).
  ~Session();

  // The next batch, in order. DEADLINE_EXCEEDED after `timeout`; OUT_OF_RANGE after the last
  // batch before stop_epoch; the daemon's status when the session ended (DATA_LOSS when the
  // dataset could not be read, ...). An UNAVAILABLE end (the daemon gone, restarting or
  // draining; one that stopped answering is found by `keepalive`) is re-attached within
  // `reconnect_timeout` (AttachOptions), inside Next: a pause, then the batch that comes
  // next; past it UNAVAILABLE naming the socket. `timeout` bounds the wait on a daemon that
  // is there: when it passes while re-attaching, DEADLINE_EXCEEDED with reconnecting() true,
  // and the next call goes on; a daemon re-attached to gets all of `timeout` for its first
  // batch. Next and Detach are called from one thread at a time.
  absl::StatusOr<Batch> Next(absl::Duration timeout = absl::InfiniteDuration());

  // The position after the last batch Next returned: what to checkpoint. Attaching with
  // start = this position resumes exactly there.
  Position position() const;
  // The daemon's view: the position after the last batch it sent on the stream.
  absl::StatusOr<Position> DaemonPosition();
  const SessionInfo& info() const { return info_; }
  // A blend's segments as the daemon last reported them (at Attach, or at a re-attach after
  // the daemon came back): AttachOptions::blend_history for a resume. Empty: no blend.
  std::vector<BlendSegment> blend_segments() const;
  // Releases the daemon refused so far (each is a bug in the caller) and the last message.
  int64_t rejected_releases() const;
  // A re-attach is under way: the daemon went away and Next() returned DEADLINE_EXCEEDED
  // before it came back. Calling Next() again goes on (within reconnect_timeout).
  bool reconnecting() const;

  // Ends the session: at once when no batch of it is held, else when the last held batch is
  // released (held batches keep their bytes; the daemon frees an ended ring's pages).
  absl::Status Detach();

 private:
  Session(std::shared_ptr<internal::SessionCore> core, SessionInfo info);
  std::shared_ptr<internal::SessionCore> core_;
  SessionInfo info_;
};

// ---- administration ----

struct DaemonStatus {
  std::string health;  // SERVING / NOT_SERVING of gpufeed.v1.Feed
  std::string version;
  int64_t uptime_ms = 0;
  uint64_t staging_total_bytes = 0;
  uint64_t staging_free_bytes = 0;
  int32_t sessions = 0;
  int32_t feeds = 0;
  bool draining = false;
  uint32_t protocol = 0;              // the daemon's (common/version.h); 0: before protocol 3
  std::vector<std::string> gpus;      // UUIDs of the GPUs the daemon sees (protocol 3 on)
  std::vector<std::string> mps_gpus;  // those of them it shares through MPS
};

struct FeedInfo {
  std::string key;
  std::string kind;
  std::string dataset;
  int64_t num_samples = 0;
  int64_t batch_size = 0;
  int32_t world_size = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = true;
  std::string share_group;  // empty: none
  int32_t sessions = 0;
  int64_t batches_produced = 0;
  uint64_t bytes_produced = 0;
  // Image datasets: by reason, those left out at open (SessionInfo::notices) included.
  std::map<std::string, int64_t> bad_samples;
  // A blended token feed: its sources as named at Attach, with their weights (empty: none).
  std::vector<std::pair<std::string, double>> blend;
  std::string pack;  // "concat" or "best_fit"; empty: rows are windows
};

struct SessionSummary {
  uint64_t session_id = 0;
  uint32_t owner_uid = 0;  // the uid that attached it
  std::string job;
  int32_t rank = 0;
  int32_t world_size = 0;
  std::string feed_key;
  std::string delivery;
  std::string gpu_uuid;  // device delivery
  Position delivered;
  int32_t ring_slots = 0;
  int32_t slots_leased = 0;
  uint64_t ring_bytes = 0;
  int64_t batches_delivered = 0;
  bool streaming = false;
  int64_t age_ms = 0;
  uint64_t bytes_delivered = 0;
  int64_t producer_blocked_ns = 0;  // the ring was full: the daemon waited for the consumer
  int64_t consumer_wait_ns = 0;     // the consumer waited for batches (its data stall)
  double cpu_decode_share = 0;      // decode auto without MPS: the CPU's share of the rows
  int64_t streaming_ns = 0;         // since the stream opened
};

class AdminClient {
 public:
  static absl::StatusOr<std::unique_ptr<AdminClient>> Connect(
      const std::string& socket = "", absl::Duration timeout = absl::Seconds(5));
  ~AdminClient();

  absl::StatusOr<DaemonStatus> GetStatus();
  absl::StatusOr<std::vector<FeedInfo>> ListFeeds();
  absl::StatusOr<std::vector<SessionSummary>> ListSessions();
  // Starts a drain (readiness NOT_SERVING, new sessions refused; the daemon exits after its
  // last session or `timeout`, zero: no limit). Returns the sessions attached.
  absl::StatusOr<int32_t> Drain(absl::Duration timeout);

 private:
  struct Impl;
  explicit AdminClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpufeed::client
