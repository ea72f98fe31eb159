// gpufeedctl consume: attach as one consumer and read batches, printing progress to stderr
// every second and, at the end, the throughput, the next position and the feed's fingerprint.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/ctl/commands/batch_io.h"
#include "client/ctl/commands/command.h"
#include "client/ctl/output.h"
#include "gpufeed/client.h"

namespace gpufeed::ctl {
namespace {

struct ConsumeFlags {
  std::string job = "default";
  std::string kind = "tokens";
  std::vector<std::string> dataset;  // one path, or several: an explicit list of shards
  std::string arrays;
  std::string token_dtype;
  std::string start_fingerprint;
  std::string elastic = "global_batch";
  std::string ids;
  std::string device;
  std::string ipc = "auto";
  std::string pipeline;
  std::string bad_sample = "skip";
  std::string decode = "auto";
  std::string augment = "auto";
  std::string dump;
  std::string share_group;
  std::vector<std::string> blend;  // NAME=WEIGHT each
  std::string blend_history;       // JSON, as a run printed it
  std::string pack = "none";
  bool no_shuffle = false;
  bool no_drop_last = false;
  bool even = false;
  bool checksum = false;
  ValueFlag rank, world_size, seq_len, vocab_size, batch_size, seed, epochs, max_batches,
      start_epoch, start_step, start_samples, ring_slots, step_ms, timeout_ms, reconnect_timeout,
      keepalive, eos_id, pack_lookahead;
};

// What the integer flags come to, with their defaults.
struct Limits {
  int64_t epochs = 1;
  int64_t max_batches = -1;  // no limit
  int64_t step_ms = 0;
  int64_t timeout_ms = 60000;
};

// The attach options and limits the flags ask for, or the first flag that is wrong.
absl::Status ReadFlags(const ConsumeFlags& flags, const GlobalFlags& global,
                       client::AttachOptions* o, Limits* limits) {
  o->socket = global.socket;
  o->job = flags.job;
  o->kind = flags.kind;
  if (flags.dataset.size() == 1) {
    o->dataset = flags.dataset.front();
  } else {
    o->dataset_paths = flags.dataset;  // tokens, webdataset: in this order
  }
  o->token_dtype = flags.token_dtype;
  o->bad_sample = flags.bad_sample;
  o->decode = flags.decode;
  o->augment = flags.augment;
  o->shuffle = !flags.no_shuffle;
  o->drop_last = !flags.no_drop_last;
  o->even = flags.even;
  o->share_group = flags.share_group;
  o->elastic = flags.elastic;
  int64_t rank = 0, world = 1, seed = 0, ring = 0;
  for (const auto& [flag, target] : std::vector<std::pair<const ValueFlag*, int64_t*>>{
           {&flags.rank, &rank},
           {&flags.world_size, &world},
           {&flags.seq_len, &o->seq_len},
           {&flags.vocab_size, &o->vocab_size},
           {&flags.batch_size, &o->batch_size},
           {&flags.seed, &seed},
           {&flags.epochs, &limits->epochs},
           {&flags.max_batches, &limits->max_batches},
           {&flags.start_epoch, &o->start.epoch},
           {&flags.start_step, &o->start.step},
           {&flags.start_samples, &o->start.samples},
           {&flags.ring_slots, &ring},
           {&flags.pack_lookahead, &o->pack_lookahead},
           {&flags.step_ms, &limits->step_ms},
           {&flags.timeout_ms, &limits->timeout_ms}}) {
    if (absl::Status s = flag->ReadInt(target); !s.ok()) return s;
  }
  absl::StatusOr<absl::Duration> reconnect =
      flags.reconnect_timeout.ReadDuration(absl::Seconds(120));
  if (!reconnect.ok()) return reconnect.status();
  o->reconnect_timeout = *reconnect;
  absl::StatusOr<absl::Duration> keepalive = flags.keepalive.ReadDuration(absl::Seconds(10));
  if (!keepalive.ok()) return keepalive.status();
  o->keepalive = *keepalive;
  // NAME=FILE,...: a tensor's name never holds '=' or ',' (the daemon checks it).
  for (absl::string_view entry : absl::StrSplit(flags.arrays, ',', absl::SkipEmpty())) {
    const size_t eq = entry.find('=');
    if (eq == absl::string_view::npos || eq == 0 || eq + 1 == entry.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--arrays: '", entry, "' is not NAME=FILE (x=x.npy,y=y.npy)"));
    }
    o->arrays.emplace_back(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  if (flags.eos_id.given()) {
    int64_t eos = 0;
    if (absl::Status s = flags.eos_id.ReadInt(&eos); !s.ok()) return s;
    o->eos_id = eos;
  }
  o->pack = flags.pack;
  // NAME=WEIGHT: split at the last '=', so a name may hold one (a weight never does).
  for (const std::string& entry : flags.blend) {
    const size_t eq = entry.rfind('=');
    double weight = 0;
    if (eq == std::string::npos || eq == 0 ||
        !absl::SimpleAtod(absl::string_view(entry).substr(eq + 1), &weight)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--blend: '", entry, "' is not NAME=WEIGHT (/data/web/=0.7)"));
    }
    o->blend.push_back({entry.substr(0, eq), weight});
  }
  if (!flags.blend_history.empty()) {
    absl::StatusOr<std::vector<client::BlendSegment>> history =
        client::ParseBlendSegmentsJson(flags.blend_history);
    if (!history.ok()) {
      // "blend_history[1].ledger: ..." as the flag: "--blend-history[1].ledger: ...".
      constexpr absl::string_view kField = "blend_history";
      absl::string_view message = history.status().message();
      if (absl::StartsWith(message, kField)) message.remove_prefix(kField.size());
      return absl::Status(history.status().code(), absl::StrCat("--blend-history", message));
    }
    o->blend_history = std::move(*history);
  }
  if (o->dataset.empty() && o->dataset_paths.empty() && o->arrays.empty() && o->blend.empty()) {
    return absl::InvalidArgumentError(
        "--dataset: required (or --arrays for records, --blend for a blend of token sources)");
  }
  if (limits->epochs < 0) return absl::InvalidArgumentError("--epochs: must be >= 0");
  o->rank = static_cast<int32_t>(rank);
  o->world_size = static_cast<int32_t>(world);
  o->seed = static_cast<uint64_t>(seed);
  o->ring_slots = static_cast<int32_t>(ring);
  if (limits->epochs != 0 &&
      __builtin_add_overflow(o->start.epoch, limits->epochs, &o->stop_epoch)) {
    return absl::InvalidArgumentError("--epochs: --start-epoch + --epochs overflows int64");
  }
  if (limits->epochs == 0) o->stop_epoch = 0;
  if (limits->epochs == 0 && limits->max_batches < 0) {
    return absl::InvalidArgumentError("--epochs 0 (no end) needs --max-batches");
  }
  return absl::OkStatus();
}

// -o json's checksum items: "checksum" the first tensor's, "checksums" each one's by name.
std::string ChecksumsJson(bool wanted, const std::vector<std::string>& names,
                          const std::vector<uint64_t>& sums) {
  if (!wanted) return "";
  std::string each;
  for (size_t t = 0; t < names.size(); ++t) {
    absl::StrAppend(&each, t == 0 ? "" : ",", JsonString(names[t]), ":", sums[t]);
  }
  return absl::StrCat(",\"checksum\":", sums.empty() ? 0 : sums[0], ",\"checksums\":{", each, "}");
}

// -o json's "notices": each of SessionInfo::notices as an object.
std::string NoticesJson(const std::vector<client::DatasetNotice>& notices) {
  std::string out;
  for (const client::DatasetNotice& n : notices) {
    absl::StrAppend(&out, out.empty() ? "" : ",", "{\"reason\":", JsonString(n.reason),
                    ",\"count\":", n.count, ",\"example\":", JsonString(n.example),
                    ",\"message\":", JsonString(n.message), "}");
  }
  return out;
}

int RunConsume(const ConsumeFlags& flags, const GlobalFlags& global) {
  client::AttachOptions o;
  Limits limits;
  if (absl::Status s = ReadFlags(flags, global, &o, &limits); !s.ok()) return Fail(s);
  std::ofstream ids_out;
  if (!flags.ids.empty()) {
    ids_out.open(flags.ids, std::ios::trunc);
    if (!ids_out) {
      return Fail(absl::PermissionDeniedError(absl::StrCat("--ids: cannot write ", flags.ids)));
    }
  }
  o.start.fingerprint = flags.start_fingerprint;
  if (!flags.pipeline.empty()) {
    std::ifstream in(flags.pipeline);
    if (!in) {
      return Fail(absl::NotFoundError(absl::StrCat("--pipeline: cannot read ", flags.pipeline)));
    }
    std::stringstream text;
    text << in.rdbuf();
    o.pipeline_json = text.str();
  }
  if (!flags.device.empty()) {
#ifndef GPUFEED_WITH_CUDA
    return Fail(absl::FailedPreconditionError("--device: gpufeedctl was built without CUDA"));
#endif
    o.delivery = "device";
    o.gpu = flags.device;
    o.ipc = flags.ipc;
  }
  const bool on_device = o.delivery == "device";

  const absl::Time start = absl::Now();
  auto session = client::Session::Attach(o);
  if (!session.ok()) return Fail(session.status());
  // Declared after the session: on every way out, the stream is synchronized and destroyed
  // before the session goes.
  ConsumerStream stream;
  if (on_device) {
    absl::StatusOr<ConsumerStream> created = ConsumerStream::Create((*session)->info().gpu_ordinal);
    if (!created.ok()) return Fail(created.status());
    stream = std::move(*created);
  }
  // What the daemon left out of the dataset, or warns about, before any batch: never silently.
  for (const client::DatasetNotice& n : (*session)->info().notices) {
    std::fprintf(stderr, "notice (%s): %s\n", n.reason.c_str(), n.message.c_str());
  }
  if (!(*session)->info().decode.empty()) {
    std::fprintf(stderr, "images: decode on %s, augment on %s\n", (*session)->info().decode.c_str(),
                 (*session)->info().augment.c_str());
  }
  int64_t batches = 0, samples = 0;
  uint64_t bytes = 0;
  std::vector<uint64_t> sums;  // --checksum: one a tensor
  std::vector<std::string> names;
  absl::Duration first_batch = absl::ZeroDuration();
  absl::Time last_report = absl::Now();
  absl::Status end;
  while (limits.max_batches < 0 || batches < limits.max_batches) {
    absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Milliseconds(limits.timeout_ms));
    // --timeout-ms bounds the wait on a daemon that is there; while gpufeedd is away,
    // --reconnect-timeout does (its end is UNAVAILABLE naming the socket and the wait).
    if (absl::IsDeadlineExceeded(batch.status()) && (*session)->reconnecting()) continue;
    if (!batch.ok()) {
      end = batch.status();
      break;
    }
    if (batches == 0) first_batch = absl::Now() - start;
    ++batches;
    samples += batch->valid_count();
    for (const auto& t : batch->tensors()) bytes += t.byte_size;
    if (on_device) {
      if (absl::Status s = batch->WaitReady(stream.get()); !s.ok()) return Fail(s);
    }
    if (ids_out.is_open()) {
      ids_out << "{\"rank\":" << o.rank << ",\"epoch\":" << batch->epoch()
              << ",\"step\":" << batch->step() << ",\"ids\":[" << absl::StrJoin(batch->ids(), ",")
              << "],\"valid\":" << batch->valid_count();
      if (flags.checksum) {
        absl::StatusOr<uint64_t> digest = BatchDigest(*batch, stream.get());
        if (!digest.ok()) return Fail(digest.status());
        ids_out << ",\"digest\":\"" << absl::StrCat(absl::Hex(*digest, absl::kZeroPad16)) << "\"";
      }
      ids_out << "}" << std::endl;  // each line whole on disk: a killed consumer's file is too
    }
    if (!flags.dump.empty() && batches == 1) {
      if (absl::Status s = DumpBatch(*batch, flags.dump, stream.get()); !s.ok()) return Fail(s);
    }
    if (flags.checksum) {
      sums.resize(batch->tensors().size(), 0);
      names.clear();
      for (size_t t = 0; t < batch->tensors().size(); ++t) {
        absl::StatusOr<uint64_t> batch_sum = BatchChecksum(*batch, t, stream.get());
        if (!batch_sum.ok()) return Fail(batch_sum.status());
        sums[t] += *batch_sum;
        names.push_back(batch->tensors()[t].name);
      }
    }
    if (limits.step_ms > 0) absl::SleepFor(absl::Milliseconds(limits.step_ms));
    batch->Release(stream.get());
    if (absl::Now() - last_report >= absl::Seconds(1)) {
      last_report = absl::Now();
      const double secs = absl::ToDoubleSeconds(last_report - start);
      std::fprintf(stderr, "rank %d: %ld batches, %.1f batches/s, %.1f MB/s\n", o.rank, batches,
                   batches / secs, bytes / secs / 1e6);
    }
  }
  stream.Synchronize();
  const double secs = std::max(1e-9, absl::ToDoubleSeconds(absl::Now() - start));
  const client::Position pos = (*session)->position();
  // Read with the position, before the detach: the segments that resume it.
  const std::string blend_json = client::BlendSegmentsJson((*session)->blend_segments());
  if (ids_out.is_open()) ids_out.flush();
  (void)(*session)->Detach();
  if (!end.ok() && !absl::IsOutOfRange(end)) {
    Fail(end);
    std::fprintf(stderr, "stopped after %ld batches at position (%ld, %ld), samples %ld\n", batches,
                 pos.epoch, pos.step, pos.samples);
    return 1;
  }
  if (global.json()) {
    std::printf(
        "{\"rank\":%d,\"batches\":%ld,\"samples\":%ld,\"bytes\":%lu,\"seconds\":%.6f,"
        "\"batches_per_s\":%.3f,\"bytes_per_s\":%.1f,\"first_batch_ms\":%.3f,"
        "\"batch_size\":%ld,\"position\":{\"epoch\":%ld,\"step\":%ld,\"samples\":%ld,"
        "\"fingerprint\":%s}%s,\"notices\":[%s]%s}\n",
        o.rank, batches, samples, bytes, secs, batches / secs, bytes / secs,
        absl::ToDoubleMilliseconds(first_batch), (*session)->info().batch_size, pos.epoch, pos.step,
        pos.samples, JsonString(pos.fingerprint).c_str(),
        ChecksumsJson(flags.checksum, names, sums).c_str(),
        NoticesJson((*session)->info().notices).c_str(),
        o.blend.empty() ? "" : absl::StrCat(",\"blend\":", blend_json).c_str());
  } else {
    std::printf(
        "rank %d: %ld batches, %ld samples, %lu bytes in %.3f s: %.1f batches/s, "
        "%.1f MB/s; first batch after %.1f ms; next position (%ld, %ld), samples %ld\n",
        o.rank, batches, samples, bytes, secs, batches / secs, bytes / secs / 1e6,
        absl::ToDoubleMilliseconds(first_batch), pos.epoch, pos.step, pos.samples);
    if (flags.checksum) {
      // The first tensor's as before; with several, each one's by name too.
      std::printf("checksum %lu\n", sums.empty() ? 0ul : sums[0]);
      for (size_t t = 0; names.size() > 1 && t < names.size(); ++t) {
        std::printf("checksum.%s %lu\n", names[t].c_str(), sums[t]);
      }
    }
    // To resume: --start-epoch/--start-step/--start-samples from the line above, and this.
    std::printf("fingerprint %s\n", pos.fingerprint.c_str());
    // And a blend's segments (--blend-history).
    if (!o.blend.empty()) std::printf("blend %s\n", blend_json.c_str());
  }
  return 0;
}

}  // namespace

Command AddConsume(CLI::App& app) {
  CLI::App* cli = app.add_subcommand("consume", "attach as one consumer and read batches");
  auto flags = std::make_shared<ConsumeFlags>();
  ConsumeFlags& f = *flags;
  cli->add_option("--job", f.job, "job name (default \"default\")")->type_name("NAME");
  f.rank.AddTo(*cli, "--rank", "R", "this consumer's rank (default 0)");
  f.world_size.AddTo(*cli, "--world-size", "W", "ranks in the job (default 1)");
  cli->add_option("--kind", f.kind, "tokens (default), records, image_folder or webdataset")
      ->type_name("KIND");
  cli->add_option("--dataset", f.dataset,
                  "dataset path, absolute (a file, a folder, or shards: a directory or a glob, "
                  "for webdataset also a brace pattern such as train-{000..146}.tar); several\n"
                  "(--dataset A B, or the flag repeated): tokens or webdataset shard files,\n"
                  "read in that order")
      ->type_name("PATH");
  cli->add_option("--arrays", f.arrays,
                  "records of several .npy arrays of one row count, one tensor each:\n"
                  "x=x.npy,y=y.npy (names in the --dataset directory) or, without\n"
                  "--dataset, x=/data/x.npy,y=/data/y.npy (all in one directory)")
      ->type_name("NAME=FILE,...");
  cli->add_option("--token-dtype", f.token_dtype,
                  "uint16 or uint32 (tokens; default: a .npy file's header, else uint16)")
      ->type_name("T");
  f.seq_len.AddTo(*cli, "--seq-len", "L", "tokens per sample (tokens)");
  f.vocab_size.AddTo(*cli, "--vocab-size", "V",
                     "tokens: refuse the file if a sample of it holds a token >= V");
  f.batch_size.AddTo(*cli, "--batch-size", "B", "samples per rank per step");
  f.seed.AddTo(*cli, "--seed", "S", "shuffle seed (default 0)");
  cli->add_flag("--no-shuffle", f.no_shuffle, "visit samples in order");
  cli->add_flag("--no-drop-last", f.no_drop_last,
                "pad the last batch of each epoch instead of dropping it");
  cli->add_flag("--even", f.even,
                "with --no-drop-last: DistributedSampler's split, every rank the same count of "
                "real samples per epoch");
  cli->add_option("--share-group", f.share_group,
                  "image datasets: read in the order of this sharing group of your jobs (its\n"
                  "name fixes the order; --seed keys only the augmentation) and share its\n"
                  "decodes: each sample is decoded once for all of the group's jobs")
      ->type_name("NAME");
  f.epochs.AddTo(*cli, "--epochs", "E",
                 "epochs to read from the start epoch (default 1; 0 = no end)");
  f.max_batches.AddTo(*cli, "--max-batches", "N", "stop after N batches (default: no limit)");
  f.start_epoch.AddTo(*cli, "--start-epoch", "E0", "resume at epoch E0 (default 0)");
  f.start_step.AddTo(*cli, "--start-step", "S0", "resume at step S0 of E0 (default 0)");
  f.start_samples.AddTo(*cli, "--start-samples", "N0",
                        "the global cursor printed with (E0, S0) (samples; default 0:\n"
                        "S0 x the saved global batch)");
  cli->add_option("--start-fingerprint", f.start_fingerprint,
                  "the fingerprint printed by the run that reached (E0, S0): refuses,\n"
                  "naming each difference, a dataset or settings other than that run's")
      ->type_name("F");
  cli->add_option("--elastic", f.elastic,
                  "resuming at another world size than the fingerprint's: global_batch\n"
                  "(default: each rank gets the saved global batch / W) or rank_batch\n"
                  "(--batch-size per rank; every sample not yet delivered, each once)")
      ->type_name("MODE");
  cli->add_option("--blend", f.blend,
                  "tokens: a weighted blend of sources instead of --dataset, one NAME=WEIGHT\n"
                  "each (the flag repeated): a token file, a directory or a glob in the last\n"
                  "component (/data/code/*.bin), weight > 0; rows come from each source in\n"
                  "proportion (Megatron-Core's blending rule)")
      ->type_name("NAME=WEIGHT");
  cli->add_option("--blend-history", f.blend_history,
                  "resuming a blend: the \"blend\" segments (JSON) the run that reached\n"
                  "(E0, S0) printed; with other weights, a new segment starts there")
      ->type_name("JSON");
  cli->add_option("--pack", f.pack,
                  "tokens: none (default: a row is one window), concat (documents end to\n"
                  "end, cut into rows) or best_fit (whole documents packed into rows);\n"
                  "packed rows come with position_ids, loss_mask and cu_seqlens")
      ->type_name("MODE");
  f.eos_id.AddTo(*cli, "--eos-id", "ID",
                 "with --pack: documents end at this token (default: a Megatron .bin's .idx)");
  f.pack_lookahead.AddTo(*cli, "--pack-lookahead", "N",
                         "--pack best_fit: documents packed together, at most (default: the\n"
                         "daemon's, 1024)");
  f.ring_slots.AddTo(*cli, "--ring-slots", "K", "ring depth (default: the daemon's)");
  f.step_ms.AddTo(*cli, "--step-ms", "MS",
                  "hold each batch MS milliseconds, as a training step would");
  f.timeout_ms.AddTo(*cli, "--timeout-ms", "MS",
                     "give up when no batch comes for MS milliseconds (default 60000;\n"
                     "while gpufeedd is away, --reconnect-timeout bounds the wait)");
  f.reconnect_timeout.AddTo(
      *cli, "--reconnect-timeout", "DURATION",
      "when gpufeedd goes away (killed, restarted, drained), re-attach at\n"
      "the next batch for up to DURATION: 120s (default), 500ms, 2m; 0 = never");
  f.keepalive.AddTo(*cli, "--keepalive", "DURATION",
                    "ping gpufeedd this often; one that does not answer for as long\n"
                    "again (stopped, frozen) counts as gone: 10s (default), 0 = no pings");
  cli->add_option("--ids", f.ids, "write one JSON line per batch: rank, epoch, step, ids, valid; with\n"
                  "--checksum also digest (FNV-1a 64 of the valid rows' bytes, every tensor)")
      ->type_name("FILE");
  cli->add_flag("--checksum", f.checksum,
                "print \"checksum <u64>\" (the first tensor's): sum over valid samples of\n"
                "sum_j (j+1)*t_j; with several tensors \"checksum.NAME <u64>\" for each too");
  cli->add_option("--device", f.device,
                  "device delivery to cuda:N or a GPU-... UUID: batches land in that\n"
                  "GPU's memory; --checksum copies each batch back to compute the sum")
      ->type_name("GPU");
  cli->add_option("--ipc", f.ipc, "device delivery: auto (default), vmm or legacy")
      ->type_name("KIND");
  cli->add_option("--pipeline", f.pipeline,
                  "image datasets: the pipeline as JSON (deploy/pipelines/*.json)")
      ->type_name("FILE");
  cli->add_option("--bad-sample", f.bad_sample,
                  "image datasets: skip (default: replace, count, log) or fail")
      ->type_name("POLICY");
  cli->add_option("--decode", f.decode,
                  "image datasets, device delivery: auto (default: nvJPEG where the\n"
                  "daemon has it), cpu or nvjpeg")
      ->type_name("WHO");
  cli->add_option("--augment", f.augment,
                  "image datasets, device delivery: auto (default: the GPU), cpu or gpu")
      ->type_name("WHERE");
  cli->add_option("--dump", f.dump,
                  "write the first batch's tensors as PREFIX.<tensor>.npy (and its ids\n"
                  "as PREFIX.ids.npy)")
      ->type_name("PREFIX");
  return {cli, [flags](const GlobalFlags& global) { return RunConsume(*flags, global); }};
}

}  // namespace gpufeed::ctl
