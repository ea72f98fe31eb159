// gpufeedd's configuration: one typed object, built once at start-up from, in order, the
// defaults, the --config file and the flags given on the command line, and validated there.
// A bad value is fatal at start-up, with the field (and for a file, the file) named.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/os/runtime_dir.h"
#include "spdlog/common.h"

namespace gpufeed::server {

// How readers copy samples from the page cache: a memcpy from a mapping (guarded against
// SIGBUS) or pread. Both turn a shrunken file into DATA_LOSS.
enum class ReadMode { kMmap, kPread };

struct DaemonConfig {
  // "unix:///path" or "unix:path": the gRPC socket; "": gpufeed.sock in the runtime directory
  // (common/os/runtime_dir.h), which Daemon::Start makes and fills in here.
  std::string listen;
  // Where the sockets go when `listen` is "": made mode 0755 if missing; where the daemon may
  // not make or write it (not root), $XDG_RUNTIME_DIR/gpufeed instead. Clients look in
  // /run/gpufeed, then $XDG_RUNTIME_DIR/gpufeed.
  std::string runtime_dir = kSystemRuntimeDir;
  // $XDG_RUNTIME_DIR at start-up (DefaultConfig reads it): runtime_dir's fallback. No flag.
  std::string xdg_runtime_dir;
  // The memory socket; empty: beside the gRPC socket, "<name>.mem.sock" (filled in by
  // validation).
  std::string mem_socket;
  uint64_t staging_bytes = uint64_t{1} << 30;
  // Device sessions stage in memfd slabs of at most this size; one session's staging must
  // fit in one. (A host ring is a memfd of its own, any size within staging_bytes.)
  uint64_t staging_slab_bytes = uint64_t{1} << 30;
  int threads = 0;  // 0: one per core (filled in by validation)
  // Threads that run Attach (open datasets, allocate rings), off gRPC's callback threads.
  int attach_threads = 2;
  int max_sessions = 256;
  int32_t ring_slots = 0;  // when Attach gives none; 0: auto (2..16 slots, up to 64 MiB a ring)
  absl::Duration attach_timeout = absl::Seconds(10);
  // Streams get this long to end at shutdown; the whole teardown, this plus 5 s, after which
  // main() exits regardless (a GPU stage that never returns must not keep a stopped daemon).
  absl::Duration shutdown_grace = absl::Seconds(2);
  // nvJPEG: the library ("" = the usual names) and interpolated chroma upsampling. Their
  // defaults come from $GPUFEED_NVJPEG_LIBRARY and $GPUFEED_NVJPEG_INTERPOLATION (0 = off),
  // read by DefaultConfig() at start-up, so older deployments keep working.
  std::string nvjpeg_library;
  bool nvjpeg_interpolation = true;
  // decode auto without MPS: the CPU pool decodes what it keeps up with, nvJPEG the rest.
  // On by default: training beside the daemon runs faster with it (docs/benchmarks.md,
  // section Adaptive decode).
  bool adaptive_decode = true;
  // A random resized crop decodes only its crop box of a CPU-decoded JPEG (bit-equal).
  bool region_decode = true;
  // adaptive_decode: the CPU takes the rows cheapest for it (images/cpu_rows.h); off: by
  // index.
  bool cheapest_cpu_rows = true;
  // The sharing groups' cache of decoded images (session/session_manager.h).
  uint64_t share_cache_bytes = uint64_t{1} << 30;
  // Sharing group names whose members may be of several uids (session/session_manager.h).
  std::vector<std::string> share_groups_across_uids;
  // s3:// datasets (objstore/object_store.h): the store ("aws", a URL, or "" for none), the
  // default signing region, connections, and the node's cache of object bytes.
  std::string s3_endpoint;
  std::string s3_region = "us-east-1";
  int s3_max_connections = 32;
  std::string cache_dir;
  uint64_t cache_bytes = 0;
  // Liveness from progress (common/progress.h): stalled once a pipeline thread has been in one
  // work item this long without finishing a sample; zero: off.
  absl::Duration stall_timeout = absl::Seconds(60);
  spdlog::level::level_enum log_level = spdlog::level::info;
  ReadMode read_mode = ReadMode::kMmap;
  // Device bytes all device rings on one GPU may hold together.
  uint64_t device_bytes = uint64_t{4} << 30;
  LogFormat log_format = LogFormat::kText;
  // TCP "host:port" for Prometheus' /metrics, and for grpc.health.v1 alone (Kubernetes'
  // gRPC probes cannot reach a Unix socket). Empty: off.
  std::string metrics_listen;
  std::string health_listen;
  // Access and quotas (docs/SECURITY.md; config.proto fields 20-26). Who may consume: these
  // uids and members of these gids; both empty: anyone who can connect. Admins (root and the
  // daemon's effective uid unless turned off below, admin_uids, members of admin_gids) always
  // may.
  std::vector<uint32_t> allow_uids;
  std::vector<uint32_t> allow_gids;
  std::vector<uint32_t> admin_uids;
  std::vector<uint32_t> admin_gids;
  // uid 0 is an admin, and the daemon's own effective uid is (fields 46, 47). The shipped
  // Kubernetes config sets both false: a root pod reaches the hostPath socket as uid 0.
  bool root_is_admin = true;
  bool daemon_uid_is_admin = true;
  // /metrics: the per-consumer series carry the job's name and its owner's uid (field 48);
  // false: an opaque per-job label instead, which shows no name or uid to a scraper.
  bool metrics_job_labels = false;
  int max_sessions_per_uid = 64;
  // 0: half of staging_bytes (StagingBytesPerUid).
  uint64_t max_staging_bytes_per_uid = 0;
  // Zero: off.
  absl::Duration idle_lease_timeout = absl::Seconds(300);
  // Bounded cost (docs/SECURITY.md §4): samples per feed (a larger dataset's Attach is
  // RESOURCE_EXHAUSTED), image file bytes (a larger file is a bad sample, too_large, never
  // read), and the daemon-wide bytes of the sessions' per-slot sample-id arrays.
  uint64_t max_samples_per_feed = uint64_t{1} << 40;
  uint64_t max_image_bytes = uint64_t{64} << 20;
  uint64_t max_ids_bytes = uint64_t{256} << 20;
  uint64_t max_ids_bytes_per_uid = 0;  // 0: half of max_ids_bytes
  // The datasets' attach-time indexes, in all and per uid (0: half).
  uint64_t max_index_bytes = uint64_t{4} << 30;
  uint64_t max_index_bytes_per_uid = 0;
  // docs/SECURITY.md sections 2 and 4: directories a dataset must lie beneath (empty:
  // anywhere), the memory socket's deadline for a whole request, and the image_folder walk's
  // bounds.
  std::vector<std::string> dataset_roots;
  absl::Duration mem_request_timeout = absl::Seconds(2);
  int64_t max_folder_entries = 10'000'000;
  absl::Duration folder_walk_timeout = absl::Seconds(120);
  // docs/SECURITY.md section 4 (config.proto fields 37-40): the gRPC socket's connections per
  // uid (admins exempt) and in all, also the caps on Stream calls not yet opened; the time a
  // Stream gets for its open message; a connection's idle time before it is closed (0: never).
  int max_connections_per_uid = 64;
  int max_connections = 1024;
  absl::Duration stream_open_timeout = absl::Seconds(10);
  absl::Duration connection_idle_timeout = absl::Seconds(300);
  // docs/SECURITY.md section 4, a slow request is its session's problem: one batch's time
  // budget (zero: none; past it the session ends, DEADLINE_EXCEEDED), and the pixels of one
  // image (a larger one is a bad sample, too_large, refused from its header).
  absl::Duration max_batch_time = absl::Seconds(120);
  uint64_t max_image_pixels = 64'000'000;
};

// max_staging_bytes_per_uid with its default resolved: half of staging_bytes when 0.
uint64_t StagingBytesPerUid(const DaemonConfig& config);

// The enums' names, as the file and the flags spell them, and back. INVALID_ARGUMENT naming
// the field and the choices: "read_mode: want mmap or pread, got 'x'".
const char* ReadModeName(ReadMode mode);
absl::StatusOr<ReadMode> ParseReadMode(absl::string_view name);
absl::StatusOr<LogFormat> ParseLogFormat(absl::string_view name);
absl::StatusOr<spdlog::level::level_enum> ParseLogLevel(absl::string_view name);

// The defaults: DaemonConfig's, with the nvJPEG settings from $GPUFEED_NVJPEG_LIBRARY and
// $GPUFEED_NVJPEG_INTERPOLATION where set (the only environment gpufeedd reads for itself).
DaemonConfig DefaultConfig();

// The names of the flags named on the command line `argv`, as absl::ParseCommandLine reads
// it: "--name", "-name", "--name=value", "--name value", "--noname" for a bool flag; nothing
// after "--". Abseil 20220623 keeps its own record of this private
// (CommandLineFlag::IsSpecifiedOnCommandLine), hence this scan.
absl::flat_hash_set<std::string> GivenFlags(int argc, const char* const* argv);

// The daemon's configuration: DefaultConfig(), then the file --config names (if any), then the
// flags in `given` (GivenFlags) and any other whose value is not its default (set through
// --flagfile or --fromenv), validated (ValidateConfig). The file is a
// gpufeed.v1.DaemonConfig in protobuf text format, or JSON when it starts with '{'; the fields
// it sets replace the defaults. NOT_FOUND for a missing file; INVALID_ARGUMENT naming the
// field, and the file (with the line, for a syntax error) where the bad value came from it.
absl::StatusOr<DaemonConfig> LoadConfig(const absl::flat_hash_set<std::string>& given);

// INVALID_ARGUMENT naming the field. Fills the derived fields (mem_socket, threads). LoadConfig
// calls it; a DaemonConfig built in code needs it before Daemon::Start.
absl::Status ValidateConfig(DaemonConfig& config);

// The socket path of a "unix://" listen address.
absl::StatusOr<std::string> UnixPathOf(const std::string& listen);

}  // namespace gpufeed::server
