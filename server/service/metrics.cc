#include "server/service/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <limits>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "server/device/device_backend.h"
#include "server/feed/feed.h"
#include "server/objstore/object_store.h"
#include "server/session/session_manager.h"
#include "server/share/share_cache.h"
#include "server/staging/staging_pool.h"

namespace gpufeed::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

struct Builder {
  // A deque: Family() hands out references that must survive later families.
  std::deque<MetricFamily> families;

  MetricFamily& Family(const std::string& name, const std::string& help, MetricType type) {
    families.push_back({name, help, type, {}});
    return families.back();
  }
  static void Add(MetricFamily& f, std::vector<ClientMetric::Label> labels, double value) {
    ClientMetric m;
    m.label = std::move(labels);
    if (f.type == MetricType::Counter) {
      m.counter.value = value;
    } else {
      m.gauge.value = value;
    }
    f.metric.push_back(std::move(m));
  }
};

// Opaque job labels (metrics_job_labels false): a random id per (owner uid, job) while the
// job has sessions, so that a scraper can follow one job's ranks without learning its name
// or owner. Ids are the kernel's random bytes (getrandom), never derived from the name.
class OpaqueJobIds {
 public:
  // The id of each of `sessions`' jobs; forgets the jobs no session has now.
  std::vector<std::string> Assign(const std::vector<SessionSnapshot>& sessions) {
    absl::MutexLock lock(&mu_);
    std::map<std::pair<uint32_t, std::string>, std::string> live;
    std::vector<std::string> out;
    out.reserve(sessions.size());
    for (const SessionSnapshot& s : sessions) {
      const auto key = std::make_pair(s.owner_uid, s.job);
      auto it = live.find(key);
      if (it == live.end()) {
        auto known = ids_.find(key);
        it = live.emplace(key, known != ids_.end() ? known->second : Fresh()).first;
      }
      out.push_back(it->second);
    }
    ids_ = std::move(live);
    return out;
  }

 private:
  static std::string Fresh() {
    unsigned char bytes[8];
    size_t got = 0;
    while (got < sizeof(bytes)) {
      const ssize_t n = ::getrandom(bytes + got, sizeof(bytes) - got, 0);
      if (n > 0) got += static_cast<size_t>(n);
    }
    return absl::StrCat("job-", absl::BytesToHexString(absl::string_view(
                                    reinterpret_cast<const char*>(bytes), sizeof(bytes))));
  }
  absl::Mutex mu_;
  std::map<std::pair<uint32_t, std::string>, std::string> ids_ ABSL_GUARDED_BY(mu_);
};

// A StageHistogram as one Prometheus histogram series with these labels.
ClientMetric HistogramMetric(const metrics::StageHistogram& h,
                             std::vector<ClientMetric::Label> labels) {
  const auto counts = h.Counts();
  ClientMetric m;
  m.label = std::move(labels);
  uint64_t cumulative = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    cumulative += counts[k];
    m.histogram.bucket.push_back({cumulative, k < metrics::StageHistogram::kBounds.size()
                                                  ? metrics::StageHistogram::kBounds[k]
                                                  : std::numeric_limits<double>::infinity()});
  }
  m.histogram.sample_count = cumulative;
  m.histogram.sample_sum = h.sum_seconds();
  return m;
}

// s3:// datasets (docs/howto/object-storage.md): per region, the requests, retries, bytes
// from the store, failures and GET latency; the node's cache's lookups, bytes, fetches,
// evictions and read-ahead. The families are there without an object store, with no series.
void AddObjectStore(const objstore::ObjectStore* store, Builder& b) {
  auto& requests =
      b.Family("gpufeed_s3_requests_total",
               "HTTP requests to the object store (every attempt), by region", MetricType::Counter);
  auto& retries =
      b.Family("gpufeed_s3_retries_total",
               "Requests that retried a failed attempt (backoff with jitter)", MetricType::Counter);
  auto& received = b.Family("gpufeed_s3_received_bytes_total",
                            "Body bytes received from the object store: what crossed the network",
                            MetricType::Counter);
  auto& errors = b.Family("gpufeed_s3_errors_total",
                          "Failed attempts by kind (connect, timeout, truncated, throttled, "
                          "server, client, other), retried or not",
                          MetricType::Counter);
  auto& failed = b.Family("gpufeed_s3_failed_calls_total",
                          "Calls that failed after all their attempts (the reader got the error)",
                          MetricType::Counter);
  auto& latency = b.Family("gpufeed_s3_get_duration_seconds",
                           "Time per successful ranged GET attempt, to its body's last byte",
                           MetricType::Histogram);
  auto& lookups = b.Family("gpufeed_object_cache_lookups_total",
                           "Block reads of the node's object cache, by result: hit (resident) or "
                           "miss (fetched, waited for a fetch, or read through)",
                           MetricType::Counter);
  auto& cache_bytes = b.Family("gpufeed_object_cache_bytes",
                               "The object cache: bytes of resident blocks, and its budget "
                               "(--cache_bytes)",
                               MetricType::Gauge);
  auto& fetched = b.Family("gpufeed_object_cache_fetched_bytes_total",
                           "Bytes the object cache fetched from the store (read-ahead included)",
                           MetricType::Counter);
  auto& evictions = b.Family("gpufeed_object_cache_evictions_total",
                             "Blocks the object cache dropped for others (farthest next use, "
                             "then least recently used)",
                             MetricType::Counter);
  auto& prefetches = b.Family("gpufeed_object_cache_prefetches_total",
                              "Read-ahead fetches started, and first reads of a block read-ahead "
                              "brought (hit)",
                              MetricType::Counter);
  if (store == nullptr) return;
  {  // one client, signed for the daemon's region
    const std::string& region = store->options().s3.region;
    const objstore::S3Counters* c = &store->counters();
    const std::vector<ClientMetric::Label> labels = {{"region", region}};
    Builder::Add(requests, labels, static_cast<double>(c->requests.load()));
    Builder::Add(retries, labels, static_cast<double>(c->retries.load()));
    Builder::Add(received, labels, static_cast<double>(c->bytes_received.load()));
    Builder::Add(failed, labels, static_cast<double>(c->failed_calls.load()));
    for (int k = 0; k < objstore::kNumS3ErrorKinds; ++k) {
      Builder::Add(errors, {{"region", region}, {"kind", objstore::kS3ErrorKindNames[k]}},
                   static_cast<double>(c->errors(static_cast<objstore::S3ErrorKind>(k))));
    }
    latency.metric.push_back(HistogramMetric(c->get_latency, labels));
  }
  if (const objstore::ObjectCache* cache = store->cache(); cache != nullptr) {
    const objstore::ObjectCacheStats s = cache->stats();
    Builder::Add(lookups, {{"result", "hit"}}, static_cast<double>(s.hits));
    Builder::Add(lookups, {{"result", "miss"}}, static_cast<double>(s.misses));
    Builder::Add(cache_bytes, {{"state", "used"}}, static_cast<double>(s.resident_bytes));
    Builder::Add(cache_bytes, {{"state", "budget"}},
                 static_cast<double>(store->options().cache_bytes));
    Builder::Add(fetched, {}, static_cast<double>(s.fetched_bytes));
    Builder::Add(evictions, {}, static_cast<double>(s.evictions));
    Builder::Add(prefetches, {{"result", "started"}}, static_cast<double>(s.prefetches));
    Builder::Add(prefetches, {{"result", "hit"}}, static_cast<double>(s.prefetch_hits));
  }
}

std::vector<MetricFamily> Collect(const MetricsSources& src, OpaqueJobIds* opaque) {
  Builder b;
  Builder::Add(b.Family("gpufeed_build_info",
                        "gpufeedd's version and whether it was built with CUDA", MetricType::Gauge),
               {{"version", src.version}, {"cuda", src.cuda ? "yes" : "no"}}, 1);

  const std::vector<SessionSnapshot> sessions = src.sessions->ListSessions();
  const std::vector<FeedSnapshot> feeds = src.sessions->ListFeeds();

  auto& by_delivery =
      b.Family("gpufeed_sessions", "Sessions attached, by delivery kind", MetricType::Gauge);
  int host = 0, device = 0;
  for (const SessionSnapshot& s : sessions) (s.delivery == DeliveryKind::kDevice ? device : host)++;
  Builder::Add(by_delivery, {{"delivery", "host"}}, host);
  Builder::Add(by_delivery, {{"delivery", "device"}}, device);
  Builder::Add(b.Family("gpufeed_feeds", "Feeds in use (a feed is shared by equal-keyed sessions)",
                        MetricType::Gauge),
               {}, static_cast<double>(feeds.size()));

  auto& batches =
      b.Family("gpufeed_batches_produced_total",
               "Per-rank batches read (and decoded, augmented) by the feed", MetricType::Counter);
  auto& samples = b.Family("gpufeed_samples_produced_total",
                           "Valid (unpadded) samples of those batches", MetricType::Counter);
  auto& bad =
      b.Family("gpufeed_bad_samples_total",
               "Samples that could not be used (image datasets), by reason", MetricType::Counter);
  for (const FeedSnapshot& f : feeds) {
    Builder::Add(batches, {{"feed", f.key}}, static_cast<double>(f.batches_produced));
    Builder::Add(samples, {{"feed", f.key}}, static_cast<double>(f.samples_produced));
    for (const auto& [reason, count] : f.bad_samples) {
      Builder::Add(bad, {{"feed", f.key}, {"reason", reason}}, static_cast<double>(count));
    }
  }
  // Blends and packing (docs/howto/blends-and-packing.md): over the stream each feed has
  // packed so far, every group counted once (rows read again after a restart are not).
  auto& blend_tokens = b.Family("gpufeed_blend_tokens_total",
                                "Document (or window) tokens a blended feed's stream has taken "
                                "from each source",
                                MetricType::Counter);
  auto& pack_tokens = b.Family("gpufeed_pack_tokens_total",
                               "Tokens of a best_fit feed's packed rows, by kind: document or "
                               "padding",
                               MetricType::Counter);
  auto& pack_documents = b.Family("gpufeed_pack_documents_total",
                                  "Documents a packed feed's stream has placed, by cut: whole "
                                  "(in one row) or truncated (cut across rows; best_fit only "
                                  "cuts those longer than a row)",
                                  MetricType::Counter);
  auto& pack_groups = b.Family("gpufeed_pack_groups_total",
                               "Groups of documents a packed feed packed, by packing: first (each "
                               "group of the stream once) or again (a group evicted from the "
                               "feed's cache and needed again: ranks or sessions reading far "
                               "apart)",
                               MetricType::Counter);
  for (const FeedSnapshot& f : feeds) {
    if (f.lm_sources.empty()) continue;
    if (f.pack != PackMode::kNone) {
      const LmDataset::Stats& s = f.lm_stats;
      Builder::Add(pack_groups, {{"feed", f.key}, {"packing", "first"}},
                   static_cast<double>(s.groups));
      Builder::Add(pack_groups, {{"feed", f.key}, {"packing", "again"}},
                   static_cast<double>(s.groups_again));
    }
    for (size_t k = 0; k < f.lm_sources.size() && k < f.lm_stats.source_tokens.size(); ++k) {
      Builder::Add(blend_tokens, {{"feed", f.key}, {"source", f.lm_sources[k]}},
                   static_cast<double>(f.lm_stats.source_tokens[k]));
    }
    if (f.pack == PackMode::kBestFit) {
      const LmDataset::Stats& s = f.lm_stats;
      Builder::Add(pack_tokens, {{"feed", f.key}, {"kind", "document"}},
                   static_cast<double>(s.row_tokens - s.pad_tokens));
      Builder::Add(pack_tokens, {{"feed", f.key}, {"kind", "padding"}},
                   static_cast<double>(s.pad_tokens));
      Builder::Add(pack_documents, {{"feed", f.key}, {"cut", "whole"}},
                   static_cast<double>(s.documents - s.truncated_documents));
      Builder::Add(pack_documents, {{"feed", f.key}, {"cut", "truncated"}},
                   static_cast<double>(s.truncated_documents));
    }
  }
  auto& delivered =
      b.Family("gpufeed_delivered_bytes_total",
               "Bytes of batches handed to consumers, by delivery kind", MetricType::Counter);
  Builder::Add(delivered, {{"delivery", "host"}},
               static_cast<double>(src.counters->delivered_bytes(0)));
  Builder::Add(delivered, {{"delivery", "device"}},
               static_cast<double>(src.counters->delivered_bytes(1)));

  auto& decodes = b.Family("gpufeed_decodes_total",
                           "Images decoded, by decoder: cpu (whole files), cpu_region (only a "
                           "random resized crop's box of a JPEG) and nvjpeg (rows it decoded)",
                           MetricType::Counter);
  for (int i = 0; i < metrics::kNumDecoders; ++i) {
    Builder::Add(decodes, {{"decoder", metrics::kDecoderNames[i]}},
                 static_cast<double>(src.counters->decodes(static_cast<metrics::Decoder>(i))));
  }

  // Staging memory by state: the pool's unallocated bytes and rings' free slots are "free".
  double filling = 0, ready = 0, leased = 0, ring_free = 0;
  for (const SessionSnapshot& s : sessions) {
    const double slot = s.ring_slots > 0 ? static_cast<double>(s.ring_bytes) / s.ring_slots : 0;
    filling += slot * s.slots_filling;
    ready += slot * s.slots_ready;
    leased += slot * s.slots_leased;
    ring_free += slot * (s.ring_slots - s.slots_filling - s.slots_ready - s.slots_leased);
  }
  auto& staging =
      b.Family("gpufeed_staging_bytes",
               "Host staging memory by state (free: unallocated, or a ring's free slots)",
               MetricType::Gauge);
  Builder::Add(staging, {{"state", "free"}},
               static_cast<double>(src.pool->free_bytes()) + ring_free);
  Builder::Add(staging, {{"state", "filling"}}, filling);
  Builder::Add(staging, {{"state", "ready"}}, ready);
  Builder::Add(staging, {{"state", "leased"}}, leased);
  // Declared in every build, with no series where there is no GPU (or no CUDA in the build):
  // one set of metric names for dashboards and the contract (tests/deploy/metrics.txt).
  auto& dev = b.Family("gpufeed_device_bytes",
                       "Device memory of the rings and scratch on each GPU (used) and what is "
                       "left of its --device_bytes budget (free)",
                       MetricType::Gauge);
  auto& mps = b.Family("gpufeed_gpu_mps",
                       "1 when the daemon's work on the GPU goes through MPS (its kernels run "
                       "beside the consumers' instead of time-sliced against them)",
                       MetricType::Gauge);
  if (src.devices != nullptr) {
    const std::vector<std::string> shared = src.devices->mps_gpu_uuids();
    for (const std::string& uuid : src.devices->gpu_uuids()) {
      Builder::Add(mps, {{"gpu", uuid}},
                   std::find(shared.begin(), shared.end(), uuid) != shared.end() ? 1 : 0);
    }
    for (const DeviceBackend::GpuMemory& g : src.devices->memory()) {
      Builder::Add(dev, {{"gpu", g.uuid}, {"state", "used"}}, static_cast<double>(g.used));
      Builder::Add(dev, {{"gpu", g.uuid}, {"state", "free"}},
                   static_cast<double>(g.budget - g.used));
    }
  }
  Builder::Add(b.Family("gpufeed_resumed_sessions_total",
                        "Attaches that resumed a client's stream after it failed (a re-attach "
                        "across a daemon restart or drain; the log line has the gap)",
                        MetricType::Counter),
               {}, static_cast<double>(src.sessions->resumed_sessions()));
  Builder::Add(b.Family("gpufeed_sessions_reclaimed_total",
                        "Sessions ended because their consumer went before opening its stream "
                        "(its lifeline connection closed), by reason",
                        MetricType::Counter),
               {{"reason", "consumer_gone"}},
               static_cast<double>(src.sessions->lifeline_reclaims()));
  // Sharing groups (docs/ARCHITECTURE.md section 9): the cache's bytes, and per group its
  // lookups, evictions, bytes and members. The group label is the group's key ("uid 1000/NAME";
  // "uid */NAME" for a group across uids)
  // with job_labels, else an opaque digest of it (as job names, group names are their user's).
  const ShareCache& cache = src.sessions->share_cache();
  const ShareCounters all = cache.counters();
  auto& cache_bytes = b.Family("gpufeed_share_cache_bytes",
                               "The sharing groups' cache of decoded images: bytes held, and "
                               "its budget (--share_cache_bytes)",
                               MetricType::Gauge);
  Builder::Add(cache_bytes, {{"state", "used"}}, static_cast<double>(all.bytes));
  Builder::Add(cache_bytes, {{"state", "budget"}}, static_cast<double>(cache.budget_bytes()));
  auto& lookups = b.Family("gpufeed_share_lookups_total",
                           "Rows a sharing group's sessions looked up in the cache, by result: "
                           "hit (no read, no decode) or miss (the session decoded it)",
                           MetricType::Counter);
  auto& evictions = b.Family("gpufeed_share_evictions_total",
                             "Decoded images a sharing group's entries lost to nearer ones",
                             MetricType::Counter);
  auto& group_bytes = b.Family("gpufeed_share_group_bytes",
                               "Bytes of a sharing group's decoded images in the cache",
                               MetricType::Gauge);
  auto& members = b.Family("gpufeed_share_members",
                           "Sessions in a sharing group", MetricType::Gauge);
  auto& read_checks = b.Family("gpufeed_share_read_checks_total",
                               "A group across uids: rows given another uid's decode only after "
                               "their own open of the file passed, or refused (read it alone)",
                               MetricType::Counter);
  auto& in_flight = b.Family("gpufeed_share_decodes_in_flight",
                             "Decodes in flight a sharing group's rows share (at most each "
                             "member's ring of rows)",
                             MetricType::Gauge);
  auto& unshared = b.Family("gpufeed_share_unshared_total",
                            "Misses decoded alone, their session holding its ring's rows of "
                            "decodes in flight",
                            MetricType::Counter);
  for (const ShareGroupInfo& g : cache.Groups()) {
    const std::string group =
        src.job_labels ? g.key : absl::StrCat("g", FeedKeyOf(g.key).substr(0, 8));
    Builder::Add(lookups, {{"group", group}, {"result", "hit"}},
                 static_cast<double>(g.counters.hits));
    Builder::Add(lookups, {{"group", group}, {"result", "miss"}},
                 static_cast<double>(g.counters.misses));
    Builder::Add(evictions, {{"group", group}}, static_cast<double>(g.counters.evictions));
    Builder::Add(group_bytes, {{"group", group}}, static_cast<double>(g.counters.bytes));
    Builder::Add(members, {{"group", group}}, g.members);
    Builder::Add(read_checks, {{"group", group}, {"result", "passed"}},
                 static_cast<double>(g.counters.read_checks_passed));
    Builder::Add(read_checks, {{"group", group}, {"result", "refused"}},
                 static_cast<double>(g.counters.read_checks_refused));
    Builder::Add(in_flight, {{"group", group}}, static_cast<double>(g.pending));
    Builder::Add(unshared, {{"group", group}}, static_cast<double>(g.counters.unshared));
  }
  Builder::Add(b.Family("gpufeed_fill_queue_depth",
                        "Fill tasks waiting for a worker (sessions with free slots, chunks)",
                        MetricType::Gauge),
               {}, static_cast<double>(src.sessions->queue_depth()));

  // Per consumer: the producer-blocked time (the consumer holds every slot), the consumer's
  // own reported wait for batches (the data stall), and its streaming wall time; the stall
  // share is rate(wait) / rate(wall). Labels: job, rank and the owner's uid (bounded by the
  // sessions; jobs are per uid, so uid 1000's "train" rank 0 and uid 1001's are two series);
  // without job_labels, job is an opaque id per (uid, job) and there is no uid: anyone who
  // can reach the port scrapes, and another user's job names and uids are theirs.
  auto& blocked = b.Family("gpufeed_producer_blocked_seconds_total",
                           "Time the session's ring was full of ready or leased batches: the "
                           "producer waited for the consumer",
                           MetricType::Counter);
  auto& wait = b.Family("gpufeed_consumer_wait_seconds_total",
                        "Time the consumer waited for its batches, as it reported (data stall)",
                        MetricType::Counter);
  auto& wall = b.Family("gpufeed_consumer_wall_seconds_total",
                        "Time since the consumer's stream opened", MetricType::Counter);
  auto& share = b.Family("gpufeed_cpu_decode_share",
                         "decode auto with --adaptive_decode: the share of each batch's rows "
                         "the CPU pool decodes now, nvJPEG the rest",
                         MetricType::Gauge);
  const std::vector<std::string> opaque_jobs =
      src.job_labels ? std::vector<std::string>() : opaque->Assign(sessions);
  for (size_t i = 0; i < sessions.size(); ++i) {
    const SessionSnapshot& s = sessions[i];
    const std::vector<ClientMetric::Label> labels =
        src.job_labels ? std::vector<ClientMetric::Label>{{"job", s.job},
                                                          {"rank", absl::StrCat(s.rank)},
                                                          {"uid", absl::StrCat(s.owner_uid)}}
                       : std::vector<ClientMetric::Label>{{"job", opaque_jobs[i]},
                                                          {"rank", absl::StrCat(s.rank)}};
    Builder::Add(blocked, labels, absl::ToDoubleSeconds(s.producer_blocked));
    Builder::Add(wait, labels, absl::ToDoubleSeconds(s.consumer_wait));
    Builder::Add(wall, labels, absl::ToDoubleSeconds(s.streaming_for));
    Builder::Add(share, labels, s.cpu_decode_share);
  }

  auto& stages = b.Family("gpufeed_stage_duration_seconds",
                          "Time per batch fill, per file read, decode and CPU augmentation, and "
                          "per batch submitted on a GPU's copy thread",
                          MetricType::Histogram);
  for (int i = 0; i < metrics::kNumStages; ++i) {
    stages.metric.push_back(
        HistogramMetric(src.counters->histogram(static_cast<metrics::Stage>(i)),
                        {{"stage", metrics::kStageNames[i]}}));
  }
  AddObjectStore(src.object_store, b);
  return {std::make_move_iterator(b.families.begin()), std::make_move_iterator(b.families.end())};
}

class Collector final : public prometheus::Collectable {
 public:
  explicit Collector(MetricsSources sources) : sources_(std::move(sources)) {}
  std::vector<MetricFamily> Collect() const override { return server::Collect(sources_, &opaque_); }

 private:
  const MetricsSources sources_;
  mutable OpaqueJobIds opaque_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen,
                                                                    MetricsSources sources) {
  if (listen.find(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_listen: want HOST:PORT (e.g. 0.0.0.0:9090), got '", listen, "'"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->host_ = listen.substr(0, listen.rfind(':'));
  try {
    // civetweb's options (prometheus-cpp's Exposer(bind_address) sets only the first four):
    // a worker per connection, so an idle connection that sent half a request held one of 2
    // workers for civetweb's default 30 s and a few of them stopped every scrape.
    server->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", listen, "num_threads", absl::StrCat(kMetricsHttpThreads),
        "request_timeout_ms", absl::StrCat(kMetricsRequestTimeoutMs)});
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("metrics_listen: cannot serve on ", listen, ": ", e.what()));
  }
  auto collector = std::make_shared<Collector>(std::move(sources));
  server->exposer_->RegisterCollectable(collector);
  server->collector_ = collector;
  return server;
}

// civetweb's mg_stop (run by ~Exposer) sets a stop flag that its listening thread reads only
// between polls of the listening sockets, each up to a second long (civetweb issue #1163,
// open): every SIGTERM or drain of a daemon with metrics took a second longer, and each
// consumer's pause with it. A connection to the port ends the poll at once, so one is made
// every 5 ms until the exposer is gone.
MetricsServer::~MetricsServer() {
  if (exposer_ == nullptr) return;  // Start failed: nothing listens
  const int bound = port();
  std::atomic<bool> gone{false};
  std::thread wake([&] {
    // Where the listener can be reached: loopback for a wildcard, else the address given.
    sockaddr_storage storage{};
    socklen_t length = 0;
    auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
    std::string host = host_;
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
      host = host.substr(1, host.size() - 2);
    }
    if (host.empty() || host == "0.0.0.0" || host == "*") host = "127.0.0.1";
    if (host == "::") host = "::1";
    if (::inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
      v4->sin_family = AF_INET;
      v4->sin_port = htons(static_cast<uint16_t>(bound));
      length = sizeof(*v4);
    } else if (::inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
      v6->sin6_family = AF_INET6;
      v6->sin6_port = htons(static_cast<uint16_t>(bound));
      length = sizeof(*v6);
    }
    if (bound == 0 || length == 0) return;  // a named host: the poll ends by itself
    while (!gone.load()) {
      // Non-blocking: a full accept queue must not hold this thread in a SYN retry.
      const int fd = ::socket(storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd >= 0) {
        (void)::connect(fd, reinterpret_cast<const sockaddr*>(&storage), length);
        ::close(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  exposer_.reset();
  gone.store(true);
  wake.join();
}

int MetricsServer::port() const {
  const std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

}  // namespace gpufeed::server
