// End-to-end: the real gpufeedd on a socket in a temp dir, driven by real consumer processes
// (gpufeedctl consume, the C ABI test program) and by the C++ client in this process.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/os/unix_socket.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gpufeed/client.h"
#include "gpufeed/v1/feed.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/harness.h"
#include "tests/testing/half.h"
#include "tests/testing/image_files.h"
#include "tests/testing/tar_builder.h"

namespace gpufeed::testing {
namespace {

using ::gpufeed::testing::EncodeJpeg;
using ::gpufeed::testing::HalfToDouble;
using ::gpufeed::testing::Picture;
using ::testing::HasSubstr;

constexpr int64_t kSeqLen = 16;
constexpr size_t kTokens = 20000;  // (20000 - 1) / 16 = 1249 samples

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_path_ = dir_.Join("tokens.bin");
    tokens_ = WriteTokens(tokens_path_, kTokens);
    daemon_ = std::make_unique<Daemon>(dir_, std::vector<std::string>{"--attach_timeout=3s"});
    ASSERT_TRUE(daemon_->ready()) << daemon_->process().Stderr();
  }

  std::vector<std::string> Consume(std::vector<std::string> extra) {
    std::vector<std::string> args = {"consume",       "--dataset",  tokens_path_, "--seq-len",
                                     absl::StrCat(kSeqLen), "--token-dtype", "uint16"};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }

  uint64_t FreeStagingBytes() {
    auto admin = client::AdminClient::Connect(daemon_->socket());
    EXPECT_TRUE(admin.ok());
    auto status = (*admin)->GetStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() ? status->staging_free_bytes : 0;
  }

  std::vector<client::SessionSummary> Sessions() {
    auto admin = client::AdminClient::Connect(daemon_->socket());
    auto sessions = (*admin)->ListSessions();
    EXPECT_TRUE(sessions.ok()) << sessions.status();
    return sessions.ok() ? *sessions : std::vector<client::SessionSummary>{};
  }

  client::AttachOptions Options() {
    client::AttachOptions o;
    o.socket = daemon_->socket();
    o.job = "cpp";
    o.kind = "tokens";
    o.dataset = tokens_path_;
    o.token_dtype = "uint16";
    o.seq_len = kSeqLen;
    o.batch_size = 8;
    return o;
  }

  TempDir dir_;
  std::string tokens_path_;
  std::vector<uint16_t> tokens_;
  std::unique_ptr<Daemon> daemon_;
};

// 4 ranks x 2 epochs: per epoch, the union of ids is exactly the samples of the full global
// batches with no duplicate, and every payload equals the file's bytes (checksums computed
// here from the file and the ids each rank reported).
TEST_F(DaemonTest, FourRanksTwoEpochsExactlyOnceAndByteExact) {
  constexpr int kWorld = 4;
  constexpr int64_t kBatch = 16;
  constexpr int64_t kSamples = (kTokens - 1) / kSeqLen;
  constexpr int64_t kSteps = kSamples / (kWorld * kBatch);
  std::vector<std::unique_ptr<Subprocess>> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.push_back(std::make_unique<Subprocess>(
        CtlArgv(daemon_->socket(),
                Consume({"--job", "four", "--rank", absl::StrCat(r), "--world-size", "4",
                         "--batch-size", absl::StrCat(kBatch), "--seed", "7", "--epochs", "2",
                         "--ids", dir_.Join(absl::StrCat("ids", r)), "--checksum", "-o",
                         "json"})),
        dir_.Join(absl::StrCat("rank", r))));
  }
  std::map<int64_t, std::vector<int64_t>> by_epoch;
  std::vector<int64_t> epoch0_rank0;
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(ranks[r]->Wait(), 0) << ranks[r]->Stderr();
    const std::vector<IdsLine> lines = ReadIdsFile(dir_.Join(absl::StrCat("ids", r)));
    ASSERT_EQ(lines.size(), static_cast<size_t>(2 * kSteps));
    for (size_t i = 0; i < lines.size(); ++i) {
      EXPECT_EQ(lines[i].rank, r);
      EXPECT_EQ(lines[i].epoch, static_cast<int64_t>(i) / kSteps);
      EXPECT_EQ(lines[i].step, static_cast<int64_t>(i) % kSteps);
      EXPECT_EQ(lines[i].valid, kBatch);
      ASSERT_EQ(lines[i].ids.size(), static_cast<size_t>(kBatch));
      auto& ids = by_epoch[lines[i].epoch];
      ids.insert(ids.end(), lines[i].ids.begin(), lines[i].ids.end());
      if (r == 0 && lines[i].epoch == 0) {
        epoch0_rank0.insert(epoch0_rank0.end(), lines[i].ids.begin(), lines[i].ids.end());
      }
    }
    const uint64_t expected = TokensChecksum(tokens_, kSeqLen, lines);
    EXPECT_EQ(static_cast<uint64_t>(JsonInt(ranks[r]->Stdout(), "checksum")), expected)
        << "rank " << r << " payload differs from the file: " << ranks[r]->Stdout();
  }
  ASSERT_EQ(by_epoch.size(), 2u);
  for (auto& [epoch, ids] : by_epoch) {
    ASSERT_EQ(ids.size(), static_cast<size_t>(kSteps * kWorld * kBatch)) << "epoch " << epoch;
    std::set<int64_t> unique(ids.begin(), ids.end());
    EXPECT_EQ(unique.size(), ids.size()) << "duplicate ids in epoch " << epoch;
    EXPECT_GE(*unique.begin(), 0);
    EXPECT_LT(*unique.rbegin(), kSamples);
  }
  // Another epoch, another order.
  EXPECT_NE(std::vector<int64_t>(by_epoch[0].begin(), by_epoch[0].begin() + 64),
            std::vector<int64_t>(by_epoch[1].begin(), by_epoch[1].begin() + 64));
}

// The C++ client sees each row byte-for-byte as in the file, in place in shared memory, and
// padding with drop_last=false wraps to the epoch's start with a valid count.
TEST_F(DaemonTest, CppClientRowsEqualFileBytesWithPadding) {
  client::AttachOptions o = Options();
  o.batch_size = 100;  // 1249 samples: 12 full batches and one of 49 valid rows
  o.drop_last = false;
  o.shuffle = false;
  o.stop_epoch = 1;
  auto session = client::Session::Attach(o);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->info().steps_per_epoch, 13);
  EXPECT_EQ((*session)->info().num_samples, 1249);
  int64_t step = 0;
  while (true) {
    absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(10));
    if (absl::IsOutOfRange(batch.status())) break;
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_EQ(batch->step(), step);
    const client::Tensor* t = batch->tensor("tokens");
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, DType::kUInt16);
    EXPECT_EQ(t->shape, (std::vector<int64_t>{100, kSeqLen + 1}));
    EXPECT_EQ(batch->valid_count(), step < 12 ? 100 : 49);
    for (int64_t r = 0; r < 100; ++r) {
      const int64_t expected_id = (step * 100 + r) % 1249;  // no shuffle: padded rows wrap
      ASSERT_EQ(batch->ids()[r], expected_id);
      const auto* row = static_cast<const uint16_t*>(t->data) + r * (kSeqLen + 1);
      ASSERT_EQ(std::memcmp(row, &tokens_[expected_id * kSeqLen], (kSeqLen + 1) * 2), 0)
          << "row " << r << " of step " << step;
    }
    const std::vector<uint8_t> mask = batch->valid_mask();
    EXPECT_EQ(std::count(mask.begin(), mask.end(), 1), batch->valid_count());
    ++step;
  }
  EXPECT_EQ(step, 13);
  EXPECT_EQ((*session)->position().epoch, 1);
  EXPECT_EQ((*session)->position().step, 0);
}

// Stop after k batches, resume from the printed position: the concatenated ids equal the
// uninterrupted run's.
TEST_F(DaemonTest, ResumeFromPositionContinuesExactly) {
  CtlResult full = RunCtl(daemon_->socket(),
                          Consume({"--job", "full", "--batch-size", "32", "--seed", "11",
                                   "--epochs", "2", "--ids", dir_.Join("full.ids")}),
                          dir_.Join("full"));
  ASSERT_EQ(full.exit_code, 0) << full.err;
  const std::vector<IdsLine> expected = ReadIdsFile(dir_.Join("full.ids"));
  ASSERT_EQ(expected.size(), 2u * (1249 / 32));

  for (int k : {5, 39, 50}) {  // mid-epoch, the epoch's last step, into the second epoch
    CtlResult first = RunCtl(daemon_->socket(),
                             Consume({"--job", "part", "--batch-size", "32", "--seed", "11",
                                      "--epochs", "2", "--max-batches", absl::StrCat(k), "--ids",
                                      dir_.Join("a.ids"), "-o", "json"}),
                             dir_.Join("a"));
    ASSERT_EQ(first.exit_code, 0) << first.err;
    const int64_t e0 = JsonInt(first.out, "epoch");
    const int64_t s0 = JsonInt(first.out, "step");
    ASSERT_GE(e0, 0) << first.out;
    CtlResult rest = RunCtl(
        daemon_->socket(),
        Consume({"--job", "part", "--batch-size", "32", "--seed", "11", "--start-epoch",
                 absl::StrCat(e0), "--start-step", absl::StrCat(s0), "--epochs",
                 absl::StrCat(2 - e0), "--ids", dir_.Join("b.ids")}),
        dir_.Join("b"));
    ASSERT_EQ(rest.exit_code, 0) << rest.err;
    std::vector<IdsLine> got = ReadIdsFile(dir_.Join("a.ids"));
    ASSERT_EQ(got.size(), static_cast<size_t>(k));
    for (IdsLine& l : ReadIdsFile(dir_.Join("b.ids"))) got.push_back(std::move(l));
    ASSERT_EQ(got.size(), expected.size()) << "k=" << k;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i].epoch, expected[i].epoch) << "k=" << k << " batch " << i;
      ASSERT_EQ(got[i].step, expected[i].step) << "k=" << k << " batch " << i;
      ASSERT_EQ(got[i].ids, expected[i].ids) << "k=" << k << " batch " << i;
    }
  }
}

// kill -9 of a consumer mid-epoch: its session is gone within 1 s, the pool's free bytes
// return to their value before it attached, the other rank goes on, and the rank can attach
// again.
TEST_F(DaemonTest, KilledConsumerLosesSessionAndSlotsReturn) {
  const uint64_t free_before = FreeStagingBytes();
  Subprocess victim(CtlArgv(daemon_->socket(),
                            Consume({"--job", "k9", "--rank", "0", "--world-size", "2",
                                     "--batch-size", "8", "--epochs", "0", "--max-batches",
                                     "1000000", "--step-ms", "20"})),
                    dir_.Join("victim"));
  Subprocess survivor(CtlArgv(daemon_->socket(),
                              Consume({"--job", "k9", "--rank", "1", "--world-size", "2",
                                       "--batch-size", "8", "--epochs", "1", "--step-ms", "2",
                                       "--checksum", "--ids", dir_.Join("survivor.ids"), "-o",
                                       "json"})),
                      dir_.Join("survivor"));
  // Wait until the victim is attached and streaming.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool seen = false;
  while (absl::Now() < deadline && !seen) {
    for (const auto& s : Sessions()) seen |= s.job == "k9" && s.rank == 0 && s.batches_delivered > 0;
    if (!seen) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(seen) << victim.Stderr();
  EXPECT_LT(FreeStagingBytes(), free_before);

  victim.Kill(SIGKILL);
  ASSERT_EQ(victim.Wait(), 128 + SIGKILL);
  const absl::Time killed = absl::Now();
  bool gone = false;
  while (!gone && absl::Now() - killed < absl::Seconds(1)) {
    gone = true;
    for (const auto& s : Sessions()) gone &= !(s.job == "k9" && s.rank == 0);
    if (!gone) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(gone) << "session of the killed consumer still listed after 1 s";

  ASSERT_EQ(survivor.Wait(), 0) << survivor.Stderr();
  const std::vector<IdsLine> lines = ReadIdsFile(dir_.Join("survivor.ids"));
  EXPECT_EQ(lines.size(), static_cast<size_t>(1249 / 16));
  EXPECT_EQ(static_cast<uint64_t>(JsonInt(survivor.Stdout(), "checksum")),
            TokensChecksum(tokens_, kSeqLen, lines));
  EXPECT_EQ(FreeStagingBytes(), free_before);

  CtlResult again = RunCtl(daemon_->socket(),
                           Consume({"--job", "k9", "--rank", "0", "--world-size", "2",
                                    "--batch-size", "8", "--max-batches", "3"}),
                           dir_.Join("again"));
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_THAT(again.out, HasSubstr("rank 0: 3 batches"));
}

struct BadInput {
  std::string name;
  std::vector<std::string> args;
  std::string code;
  std::string message;
};

TEST_F(DaemonTest, BadInputsGetTheirCodeAndAMessageNamingTheFieldOrPath) {
  const std::string empty = dir_.Join("empty.bin");
  WriteTokens(empty, 0);
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::FILE* f = std::fopen(dir_.Join(name).c_str(), "wb");
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    return dir_.Join(name);
  };
  auto npy = [&](const std::string& name, const std::string& dict, size_t data_bytes) {
    std::string header = dict;
    while ((10 + header.size() + 1) % 64 != 0) header += ' ';
    header += '\n';
    std::string bytes = std::string("\x93NUMPY\x01\x00", 8);
    bytes += static_cast<char>(header.size() & 0xff);
    bytes += static_cast<char>(header.size() >> 8);
    bytes += header + std::string(data_bytes, '\0');
    return write(name, bytes);
  };
  const std::string fortran =
      npy("f.npy", "{'descr': '<f4', 'fortran_order': True, 'shape': (4, 3), }", 48);
  const std::string object =
      npy("o.npy", "{'descr': '|O', 'fortran_order': False, 'shape': (4,), }", 32);
  const std::string malformed = npy("m.npy", "{'descr': '<f4', 'fortran_order': Fa", 48);
  const std::string missing = dir_.Join("no-such-file.bin");
  const std::string bad_pipeline = write(
      "bad.json", R"({"ops": [{"center_crop": {"size": 224}}, {"flip": {"p": 2}}]})");
  const std::string eval_pipeline = std::string(GPUFEED_SOURCE_DIR) + "/deploy/pipelines/imagenet_eval.json";

  const std::vector<std::string> base = {"consume", "--seq-len", "16", "--batch-size", "8",
                                         "--max-batches", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> v = base;
    v.insert(v.end(), extra.begin(), extra.end());
    return v;
  };
  const std::vector<BadInput> cases = {
      {"missing file", with({"--dataset", missing}), "NOT_FOUND", missing},
      {"empty file", with({"--dataset", empty}), "INVALID_ARGUMENT", "is empty"},
      {"seq_len too large",
       {"consume", "--dataset", tokens_path_, "--seq-len", "20000", "--batch-size", "1"},
       "INVALID_ARGUMENT",
       "dataset.seq_len"},
      {"batch size 0",
       {"consume", "--dataset", tokens_path_, "--seq-len", "16", "--batch-size", "0"},
       "INVALID_ARGUMENT",
       "batch_size"},
      {"world size 0", with({"--dataset", tokens_path_, "--world-size", "0"}), "INVALID_ARGUMENT",
       "world_size"},
      {"rank >= world", with({"--dataset", tokens_path_, "--world-size", "2", "--rank", "2"}),
       "INVALID_ARGUMENT", "rank"},
      {"relative path", with({"--dataset", "tokens.bin"}), "INVALID_ARGUMENT", "dataset.path"},
      {"unknown kind", with({"--dataset", tokens_path_, "--kind", "images"}), "INVALID_ARGUMENT",
       "kind"},
      {"fortran npy",
       {"consume", "--kind", "records", "--dataset", fortran, "--batch-size", "1"},
       "INVALID_ARGUMENT",
       "Fortran"},
      {"object npy",
       {"consume", "--kind", "records", "--dataset", object, "--batch-size", "1"},
       "INVALID_ARGUMENT",
       "object"},
      {"malformed npy",
       {"consume", "--kind", "records", "--dataset", malformed, "--batch-size", "1"},
       "INVALID_ARGUMENT",
       "malformed .npy header"},
      {"ring too large for the pool",
       {"consume", "--dataset", tokens_path_, "--seq-len", "19000", "--batch-size", "1000",
        "--ring-slots", "2", "--no-drop-last"},
       "RESOURCE_EXHAUSTED",
       "asked for"},
      {"start past the epoch", with({"--dataset", tokens_path_, "--start-step", "1000"}),
       "INVALID_ARGUMENT", "start.step"},
      {"bad pipeline op",
       {"consume", "--kind", "image_folder", "--dataset", dir_.path(), "--batch-size", "2",
        "--pipeline", bad_pipeline},
       "INVALID_ARGUMENT",
       "pipeline[1] flip: p"},
      {"image_folder without a pipeline",
       {"consume", "--kind", "image_folder", "--dataset", dir_.path(), "--batch-size", "2"},
       "INVALID_ARGUMENT",
       "output size must be fixed"},
      {"pipeline for tokens", with({"--dataset", tokens_path_, "--pipeline", eval_pipeline}),
       "INVALID_ARGUMENT", "pipeline: only image_folder and webdataset datasets"},
      {"pipeline not JSON", with({"--dataset", tokens_path_, "--pipeline", tokens_path_}),
       "INVALID_ARGUMENT", "pipeline: not JSON"},
  };
  for (const BadInput& c : cases) {
    CtlResult r = RunCtl(daemon_->socket(), c.args, dir_.Join("bad"));
    EXPECT_EQ(r.exit_code, 1) << c.name << ": " << r.out << r.err;
    EXPECT_THAT(r.err, HasSubstr("error: " + c.code + ": ")) << c.name;
    EXPECT_THAT(r.err, HasSubstr(c.message)) << c.name;
  }
  // Nothing leaked: every refused attach returned what it reserved.
  EXPECT_TRUE(Sessions().empty());
  auto admin = client::AdminClient::Connect(daemon_->socket());
  auto status = (*admin)->GetStatus();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->staging_free_bytes, status->staging_total_bytes);
  EXPECT_EQ(status->health, "SERVING");
}

// An ImageFolder tree of JPEGs through the ImageNet training pipeline: 2 ranks receive every
// image of the epoch exactly once, float16 [B, 3, 224, 224] images with their labels, and the
// same (seed, epoch) gives the same bytes on a second run.
TEST_F(DaemonTest, ImageFolderTwoRanksThroughTheImagenetPipeline) {
  const std::string root = dir_.Join("images");
  for (int c = 0; c < 3; ++c) {
    for (int i = 0; i < 8; ++i) {
      const std::string path = absl::StrCat(root, "/class", c, "/img", i, ".jpg");
      std::filesystem::create_directories(std::filesystem::path(path).parent_path());
      const std::vector<uint8_t> jpeg = EncodeJpeg(Picture(48 + i, 64, 3, c * 8 + i), 48 + i, 64,
                                                   TJPF_RGB, TJSAMP_420, 90);
      std::ofstream(path, std::ios::binary)
          .write(reinterpret_cast<const char*>(jpeg.data()), static_cast<std::streamsize>(jpeg.size()));
    }
  }
  const std::string pipeline = std::string(GPUFEED_SOURCE_DIR) + "/deploy/pipelines/imagenet_train.json";
  std::string sums[2];
  for (int run = 0; run < 2; ++run) {
    std::vector<std::unique_ptr<Subprocess>> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.push_back(std::make_unique<Subprocess>(
          CtlArgv(daemon_->socket(),
                  {"consume", "--job", absl::StrCat("img", run), "--kind", "image_folder",
                   "--dataset", root, "--pipeline", pipeline, "--rank", absl::StrCat(r),
                   "--world-size", "2", "--batch-size", "4", "--seed", "3", "--epochs", "1",
                   "--ids", dir_.Join(absl::StrCat("img", run, r)), "--checksum", "-o", "json"}),
          dir_.Join(absl::StrCat("imgrank", run, r))));
    }
    std::vector<int64_t> ids;
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(ranks[r]->Wait(), 0) << ranks[r]->Stderr();
      for (const IdsLine& l : ReadIdsFile(dir_.Join(absl::StrCat("img", run, r)))) {
        ids.insert(ids.end(), l.ids.begin(), l.ids.end());
      }
      sums[run] += absl::StrCat(JsonInt(ranks[r]->Stdout(), "checksum"), ",");
      EXPECT_EQ(JsonInt(ranks[r]->Stdout(), "bytes"), 3 * (4 * 3 * 224 * 224 * 2 + 4 * 8));
    }
    std::sort(ids.begin(), ids.end());
    std::vector<int64_t> all(24);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(ids, all);  // 24 images, 2 ranks x 3 steps x 4: each exactly once
  }
  EXPECT_EQ(sums[0], sums[1]);

  // The pixels themselves, against a reference computed here: JPEGs of one colour each (a
  // different value per channel), which every crop, flip and antialiased resize leaves as it
  // is, so each output value is (rgb / 255 - mean[c]) / std[c], NCHW, channels in RGB order,
  // where rgb is the test's own decode of the file. Tolerance: 1 level of 255 over the
  // smallest std (the resize's float sums) plus float16's rounding at |v| < 2.7 (2^-10).
  const std::string flat = dir_.Join("flat");
  std::vector<std::array<uint8_t, 3>> colours;  // by sample id: class c, image i -> id 2c + i
  for (int c = 0; c < 3; ++c) {
    for (int i = 0; i < 2; ++i) {
      const uint8_t rgb[3] = {static_cast<uint8_t>(30 + 80 * c + 20 * i),
                              static_cast<uint8_t>(220 - 60 * c),
                              static_cast<uint8_t>(100 + 50 * i)};
      std::vector<uint8_t> pixels(static_cast<size_t>(40 + 9 * i) * 56 * 3);
      for (size_t p = 0; p < pixels.size(); ++p) pixels[p] = rgb[p % 3];
      const std::vector<uint8_t> jpeg =
          EncodeJpeg(pixels, 40 + 9 * i, 56, TJPF_RGB, TJSAMP_420, 90);
      testing::WriteFileBytes(absl::StrCat(flat, "/class", c, "/img", i, ".jpg"), jpeg);
      int h = 0, w = 0;
      const std::vector<uint8_t> decoded = testing::DecodeJpegRgb(jpeg, &h, &w);
      for (size_t p = 0; p < decoded.size(); ++p) {
        ASSERT_EQ(decoded[p], decoded[p % 3]) << "the decode of a flat JPEG is not flat";
      }
      colours.push_back({decoded[0], decoded[1], decoded[2]});
    }
  }
  std::ifstream json_file(pipeline);
  client::AttachOptions o = Options();
  o.job = "img-pixels";
  o.kind = "image_folder";
  o.dataset = flat;
  o.pipeline_json.assign(std::istreambuf_iterator<char>(json_file), {});
  o.batch_size = 6;
  o.seed = 3;
  o.stop_epoch = 1;
  auto session = client::Session::Attach(o);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(30));
  ASSERT_TRUE(batch.ok()) << batch.status();
  const client::Tensor* image = batch->tensor("image");
  const client::Tensor* label = batch->tensor("label");
  ASSERT_NE(image, nullptr);
  ASSERT_NE(label, nullptr);
  ASSERT_EQ(image->dtype, DType::kFloat16);
  ASSERT_EQ(image->shape, (std::vector<int64_t>{6, 3, 224, 224}));
  const double mean[3] = {0.485, 0.456, 0.406}, stddev[3] = {0.229, 0.224, 0.225};
  const double tolerance = 1.0 / 255 / 0.224 + 2.7 / 1024;
  const auto* half = static_cast<const uint16_t*>(image->data);
  constexpr size_t kPlane = 224 * 224;
  for (size_t r = 0; r < 6; ++r) {
    const int64_t id = batch->ids()[r];
    ASSERT_TRUE(id >= 0 && id < 6) << id;
    EXPECT_EQ(static_cast<const int64_t*>(label->data)[r], id / 2) << "sample " << id;
    for (int c = 0; c < 3; ++c) {
      const double want = (colours[static_cast<size_t>(id)][c] / 255.0 - mean[c]) / stddev[c];
      double worst = 0;
      for (size_t p = 0; p < kPlane; ++p) {
        worst = std::max(worst, std::abs(HalfToDouble(half[(r * 3 + c) * kPlane + p]) - want));
      }
      EXPECT_LE(worst, tolerance) << "sample " << id << " channel " << c << ": want " << want;
    }
  }
}

// Bad images end to end: skipped ones are replaced and counted in `feeds`; with
// --bad-sample fail the stream ends with DATA_LOSS naming the file.
TEST_F(DaemonTest, BadImagesAreCountedInFeedsOrFailTheStream) {
  const std::string root = dir_.Join("bad-images");
  std::filesystem::create_directories(root + "/c");
  std::ofstream(root + "/c/0.jpg");  // empty
  std::ofstream(root + "/c/1.png") << "not a png";
  for (int i = 2; i < 8; ++i) {
    const std::vector<uint8_t> jpeg = EncodeJpeg(Picture(20, 20, 3, i), 20, 20);
    std::ofstream(absl::StrCat(root, "/c/", i, ".jpg"), std::ios::binary)
        .write(reinterpret_cast<const char*>(jpeg.data()), static_cast<std::streamsize>(jpeg.size()));
  }
  client::AttachOptions o = Options();
  o.kind = "image_folder";
  o.dataset = root;
  o.batch_size = 8;
  o.shuffle = false;
  o.pipeline_json = R"({"ops": [{"center_crop": {"size": 16}}]})";
  o.stop_epoch = 1;  // counts are per epoch: fill one
  auto session = client::Session::Attach(o);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(10));
  ASSERT_TRUE(batch.ok()) << batch.status();
  // Ids 0 and 1 are bad: both replaced by 2, the next good image.
  EXPECT_EQ(batch->ids(), (std::vector<int64_t>{2, 2, 2, 3, 4, 5, 6, 7}));
  auto admin = client::AdminClient::Connect(daemon_->socket());
  auto feeds = (*admin)->ListFeeds();
  ASSERT_TRUE(feeds.ok());
  ASSERT_EQ(feeds->size(), 1u);
  EXPECT_EQ((*feeds)[0].kind, "image_folder");
  // Each bad file counts once for the sample that asked for it.
  EXPECT_EQ((*feeds)[0].bad_samples.at("empty"), 1);
  EXPECT_EQ((*feeds)[0].bad_samples.at("not_an_image"), 1);
  EXPECT_EQ((*feeds)[0].bad_samples.at("truncated"), 0);
  batch->Release();
  ASSERT_TRUE((*session)->Detach().ok());

  std::ofstream(dir_.Join("cc.json")) << R"({"ops": [{"center_crop": {"size": 16}}]})";
  CtlResult fail = RunCtl(daemon_->socket(),
                          {"consume", "--kind", "image_folder", "--dataset", root, "--pipeline",
                           dir_.Join("cc.json"), "--batch-size", "8", "--no-shuffle",
                           "--bad-sample", "fail"},
                          dir_.Join("badfail"));
  EXPECT_EQ(fail.exit_code, 1);
  EXPECT_THAT(fail.err, HasSubstr("DATA_LOSS"));
  EXPECT_THAT(fail.err, HasSubstr(root + "/c/0.jpg (empty)"));
  EXPECT_TRUE(daemon_->process().Running());
}

// The client library opens the dataset with this process's rights (docs/SECURITY.md section
// 2): what goes wrong there is said in its own words, naming the path and the errno.
TEST_F(DaemonTest, TheClientOpensTheDatasetAndNamesWhatGoesWrong) {
  client::AttachOptions missing = Options();
  missing.dataset = dir_.Join("nope.bin");
  auto s = client::Session::Attach(missing);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.status().message(),
            absl::StrCat("attach: dataset.path: this process (uid ", ::geteuid(), ") cannot open ",
                         missing.dataset, " (errno 2): No such file or directory"));
  client::AttachOptions fifo = Options();
  fifo.dataset = dir_.Join("fifo.bin");
  ASSERT_EQ(::mkfifo(fifo.dataset.c_str(), 0644), 0);
  s = client::Session::Attach(fifo);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(),
            "attach: dataset.path: " + fifo.dataset + " is a FIFO, not a regular file");
  client::AttachOptions folder = Options();
  folder.kind = "image_folder";
  folder.dataset = tokens_path_;  // a file where a folder belongs: O_DIRECTORY refuses it
  s = client::Session::Attach(folder);
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("cannot open " + tokens_path_ + " (errno 20): Not a directory"));
  // And the daemon still serves a good one, which it read through the passed descriptor.
  auto good = client::Session::Attach(Options());
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_TRUE((*good)->Detach().ok());
}

TEST_F(DaemonTest, SecondAttachOfTheSameRankIsAlreadyExists) {
  auto first = client::Session::Attach(Options());
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = client::Session::Attach(Options());
  ASSERT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("job 'cpp' rank 0"));
  client::AttachOptions other = Options();
  other.rank = 1;
  other.world_size = 2;
  auto mismatched = client::Session::Attach(other);
  EXPECT_EQ(mismatched.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(mismatched.status().message()), HasSubstr("job 'cpp'"));
}

// Raw protocol: what the client library never sends must still be refused cleanly.
class RawProtocolTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    channel_ = grpc::CreateChannel("unix://" + daemon_->socket(),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Feed::NewStub(channel_);
  }

  // Passes `fd` on the memory socket as open_dataset does (docs/SECURITY.md section 2).
  v1::MemResponse OpenDataset(int fd) {
    v1::MemResponse reply;
    absl::StatusOr<UniqueFd> conn = ConnectUnix(dir_.Join("gf.mem.sock"));
    EXPECT_TRUE(conn.ok()) << conn.status();
    if (!conn.ok()) return reply;
    EXPECT_TRUE(SetSocketTimeout(conn->get(), absl::Seconds(5)).ok());
    v1::MemRequest request;
    request.set_open_dataset(true);
    EXPECT_TRUE(SendFrame(conn->get(), request.SerializeAsString(), fd).ok());
    absl::StatusOr<Frame> frame = RecvFrame(conn->get(), 1 << 16);
    EXPECT_TRUE(frame.ok()) << frame.status();
    if (frame.ok()) {
      EXPECT_TRUE(reply.ParseFromString(frame->bytes));
    }
    return reply;
  }

  // A handle for the tokens file, opened by this process as the client library does.
  std::string TokensHandle() {
    UniqueFd fd(::open(tokens_path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
    EXPECT_TRUE(fd.valid());
    v1::MemResponse reply = OpenDataset(fd.get());
    EXPECT_EQ(reply.code(), 0) << reply.message();
    return reply.dataset_handle();
  }

  // The tokens file by handle: what the client library sends. (A raw attach by path would
  // need an admin; the handle works for every caller.)
  v1::AttachRequest Request() {
    v1::AttachRequest r;
    r.set_job("raw");
    r.set_world_size(1);
    r.mutable_dataset()->set_kind(v1::DATASET_KIND_TOKENS);
    r.mutable_dataset()->set_path(tokens_path_);
    r.mutable_dataset()->set_handle(TokensHandle());
    r.mutable_dataset()->set_token_dtype(v1::DTYPE_UINT16);
    r.mutable_dataset()->set_seq_len(kSeqLen);
    r.set_batch_size(4);
    r.set_ring_slots(2);
    return r;
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Feed::Stub> stub_;
};

TEST_F(RawProtocolTest, UnknownEnumsAndDeviceDeliveryAreRefused) {
  v1::AttachResponse response;
  {
    v1::AttachRequest r = Request();
    r.mutable_dataset()->set_kind(static_cast<v1::DatasetKind>(7));
    grpc::ClientContext ctx;
    grpc::Status s = stub_->Attach(&ctx, r, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("dataset.kind"));
  }
  {
    v1::AttachRequest r = Request();
    r.mutable_delivery()->set_kind(v1::DELIVERY_KIND_DEVICE);
    grpc::ClientContext ctx;
    grpc::Status s = stub_->Attach(&ctx, r, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(s.error_message(), HasSubstr("no CUDA device visible to gpufeedd"));
  }
  {
    v1::AttachRequest r = Request();
    r.mutable_dataset()->set_token_dtype(v1::DTYPE_FLOAT32);
    grpc::ClientContext ctx;
    grpc::Status s = stub_->Attach(&ctx, r, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("dataset.token_dtype"));
  }
}

TEST_F(RawProtocolTest, BadReleasesAreRejectedAndTheSessionGoesOn) {
  v1::AttachResponse attached;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attach(&ctx, Request(), &attached).ok());
  }
  ASSERT_EQ(attached.ring_slots(), 2);
  grpc::ClientContext ctx;
  auto stream = stub_->Stream(&ctx);
  v1::StreamRequest open;
  open.mutable_open()->set_session_id(attached.session_id());
  open.mutable_open()->set_token(attached.token());
  ASSERT_TRUE(stream->Write(open));
  // Reads until `batches` batches or one rejection arrived.
  std::vector<v1::BatchReady> got;
  std::vector<v1::ReleaseRejected> rejected;
  auto read = [&](size_t batches) {
    while (got.size() < batches && rejected.empty()) {
      v1::StreamResponse r;
      if (!stream->Read(&r)) return false;
      got.insert(got.end(), r.batches().begin(), r.batches().end());
      rejected.insert(rejected.end(), r.rejected().begin(), r.rejected().end());
    }
    return true;
  };
  ASSERT_TRUE(read(2));
  ASSERT_EQ(got.size(), 2u);  // the ring holds 2: nothing more comes before a release
  EXPECT_EQ(got[0].step(), 0);
  EXPECT_EQ(got[1].step(), 1);
  const v1::BatchReady first = got[0];

  auto release = [&](int32_t slot, uint64_t generation) {
    v1::StreamRequest r;
    v1::Release* rel = r.add_releases();
    rel->set_slot(slot);
    rel->set_generation(generation);
    return stream->Write(r);
  };
  // A slot outside the ring, a stale generation: refused, named, and the stream goes on.
  ASSERT_TRUE(release(5, 1));
  ASSERT_TRUE(read(100));
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_EQ(rejected[0].code(), static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  EXPECT_EQ(rejected[0].slot(), 5);
  EXPECT_THAT(rejected[0].message(), HasSubstr("slot 5"));
  rejected.clear();
  ASSERT_TRUE(release(first.slot(), first.generation() + 1));
  ASSERT_TRUE(read(100));
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_THAT(rejected[0].message(), HasSubstr("stale generation"));
  rejected.clear();
  EXPECT_EQ(got.size(), 2u);  // no batch came for a refused release
  // The right release: the slot is refilled with step 2 and a new generation.
  ASSERT_TRUE(release(first.slot(), first.generation()));
  ASSERT_TRUE(read(3));
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[2].step(), 2);
  EXPECT_EQ(got[2].slot(), first.slot());
  EXPECT_EQ(got[2].generation(), first.generation() + 1);
  // The old generation again: the slot holds a newer one now.
  ASSERT_TRUE(release(first.slot(), first.generation()));
  ASSERT_TRUE(read(100));
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_THAT(rejected[0].message(), HasSubstr("stale generation"));
  ctx.TryCancel();
}

TEST_F(RawProtocolTest, StreamWithAWrongTokenIsPermissionDenied) {
  v1::AttachResponse attached;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->Attach(&ctx, Request(), &attached).ok());
  }
  grpc::ClientContext ctx;
  auto stream = stub_->Stream(&ctx);
  v1::StreamRequest open;
  open.mutable_open()->set_session_id(attached.session_id());
  open.mutable_open()->set_token("00000000000000000000000000000000");
  stream->Write(open);
  v1::StreamResponse reply;
  EXPECT_FALSE(stream->Read(&reply));
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

// The memory socket answers garbage, oversized frames and wrong tokens with an error and
// keeps serving; the descriptor goes only to the token's holder.
TEST_F(RawProtocolTest, MemorySocketRefusesWhatItShouldAndSurvivesGarbage) {
  const std::string mem = dir_.Join("gf.mem.sock");
  auto ask = [&](const std::string& payload, bool raw) -> absl::StatusOr<Frame> {
    GPUFEED_ASSIGN_OR_RETURN(UniqueFd conn, ConnectUnix(mem));
    GPUFEED_RETURN_IF_ERROR(SetSocketTimeout(conn.get(), absl::Seconds(5)));
    if (raw) {
      if (::write(conn.get(), payload.data(), payload.size()) < 0) {
        return absl::InternalError("write");
      }
      ::shutdown(conn.get(), SHUT_WR);
    } else {
      GPUFEED_RETURN_IF_ERROR(SendFrame(conn.get(), payload));
    }
    return RecvFrame(conn.get(), 1 << 16);
  };
  auto code_of = [](const Frame& f) {
    v1::MemResponse r;
    EXPECT_TRUE(r.ParseFromString(f.bytes));
    return r.code();
  };
  // Not a protobuf; a length header claiming 4 GiB; a truncated frame.
  absl::StatusOr<Frame> junk = ask("\xff\xff\xff\x7fjunkjunk", false);
  ASSERT_TRUE(junk.ok()) << junk.status();
  EXPECT_NE(code_of(*junk), 0);
  EXPECT_FALSE(junk->fd.valid());
  absl::StatusOr<Frame> huge = ask(std::string("\xff\xff\xff\xff", 4), true);
  ASSERT_TRUE(huge.ok()) << huge.status();
  EXPECT_EQ(code_of(*huge), static_cast<int>(absl::StatusCode::kInvalidArgument));
  absl::StatusOr<Frame> cut = ask(std::string("\x10\x00\x00\x00" "abc", 7), true);
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_NE(code_of(*cut), 0);

  v1::AttachResponse attached;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->Attach(&ctx, Request(), &attached).ok());
  v1::MemRequest request;
  request.set_session_id(attached.session_id());
  request.set_token("not the token");
  absl::StatusOr<Frame> wrong = ask(request.SerializeAsString(), false);
  ASSERT_TRUE(wrong.ok());
  EXPECT_EQ(code_of(*wrong), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_FALSE(wrong->fd.valid());
  request.set_token(attached.token());
  absl::StatusOr<Frame> right = ask(request.SerializeAsString(), false);
  ASSERT_TRUE(right.ok());
  EXPECT_EQ(code_of(*right), 0);
  EXPECT_TRUE(right->fd.valid());
  // Still serving.
  CtlResult after = RunCtl(daemon_->socket(), Consume({"--batch-size", "8", "--max-batches", "2"}),
                           dir_.Join("after"));
  EXPECT_EQ(after.exit_code, 0) << after.err;
}

// A dataset handle is spent by the Attach that names it; a FIFO is refused before it is one.
TEST_F(RawProtocolTest, DatasetHandlesAreSingleUseAndFifosAreRefused) {
  v1::AttachRequest r = Request();
  {
    v1::AttachResponse attached;
    grpc::ClientContext ctx;
    grpc::Status s = stub_->Attach(&ctx, r, &attached);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  r.set_job("raw-again");
  v1::AttachResponse response;
  grpc::ClientContext ctx;
  grpc::Status again = stub_->Attach(&ctx, r, &response);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(again.error_message(), HasSubstr("dataset.handle: no such handle"));

  const std::string fifo = dir_.Join("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  UniqueFd fd(::open(fifo.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  ASSERT_TRUE(fd.valid());
  v1::MemResponse refused = OpenDataset(fd.get());
  EXPECT_EQ(refused.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(refused.message(),
            "open_dataset: the descriptor passed is a FIFO, not a regular file or a directory");
  EXPECT_TRUE(refused.dataset_handle().empty());
  // The client library refuses it itself, naming the path, and never blocks on it.
  CtlResult ctl = RunCtl(daemon_->socket(),
                         {"consume", "--dataset", fifo, "--token-dtype", "uint16", "--seq-len",
                          "4", "--batch-size", "1", "--max-batches", "1"},
                         dir_.Join("fifo-out"));
  EXPECT_NE(ctl.exit_code, 0);
  EXPECT_THAT(ctl.err, HasSubstr("dataset.path: " + fifo + " is a FIFO, not a regular file"));
}

// One client dribbling its memory-socket request a byte every 0.9 s is cut
// off at mem_request_timeout (2 s) for the whole request, and delays nobody meanwhile.
TEST_F(RawProtocolTest, ADribblingMemoryClientIsCutOffAndDelaysNobody) {
  absl::StatusOr<UniqueFd> slow = ConnectUnix(dir_.Join("gf.mem.sock"));
  ASSERT_TRUE(slow.ok()) << slow.status();
  ASSERT_TRUE(SetSocketTimeout(slow->get(), absl::Seconds(10)).ok());
  const absl::Time connected = absl::Now();
  std::atomic<bool> stop{false};
  std::thread dribbler([&] {
    const std::string wire = std::string("\x10\x00\x00\x00", 4) + std::string(16, 'x');
    for (size_t i = 0; i < wire.size() && !stop.load(); ++i) {
      if (::send(slow->get(), &wire[i], 1, MSG_NOSIGNAL) != 1) return;
      absl::SleepFor(absl::Milliseconds(900));
    }
  });
  const absl::Time started = absl::Now();
  CtlResult ctl = RunCtl(daemon_->socket(), Consume({"--batch-size", "8", "--max-batches", "2"}),
                         dir_.Join("fast"));
  EXPECT_EQ(ctl.exit_code, 0) << ctl.err;
  EXPECT_LT(absl::Now() - started, absl::Milliseconds(1500));
  absl::StatusOr<Frame> cut = RecvFrame(slow->get(), 1 << 16);
  const absl::Duration took = absl::Now() - connected;
  stop = true;
  dribbler.join();
  ASSERT_TRUE(cut.ok()) << cut.status();
  v1::MemResponse reply;
  ASSERT_TRUE(reply.ParseFromString(cut->bytes));
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(reply.message(),
            "memory socket: the request did not arrive within 2s (mem_request_timeout)");
  EXPECT_GE(took, absl::Milliseconds(1900));
  EXPECT_LT(took, absl::Milliseconds(3500));
}

// A session whose stream never opens is ended after --attach_timeout and its memory freed.
TEST_F(RawProtocolTest, AttachWithoutStreamExpires) {
  v1::AttachResponse attached;
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->Attach(&ctx, Request(), &attached).ok());
  EXPECT_EQ(Sessions().size(), 1u);
  const absl::Time deadline = absl::Now() + absl::Seconds(6);
  while (!Sessions().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(Sessions().empty());
  auto admin = client::AdminClient::Connect(daemon_->socket());
  auto status = (*admin)->GetStatus();
  EXPECT_EQ(status->staging_free_bytes, status->staging_total_bytes);
}

// SIGTERM: health goes NOT_SERVING, streams end with UNAVAILABLE, exit 0 within 5 s. (The
// consumer does not re-attach: reattach_test.cc has that.)
TEST_F(DaemonTest, SigtermEndsStreamsWithUnavailableAndExitsZero) {
  Subprocess consumer(CtlArgv(daemon_->socket(),
                              Consume({"--batch-size", "8", "--epochs", "0", "--max-batches",
                                       "100000000", "--step-ms", "5", "--reconnect-timeout",
                                       "0"})),
                      dir_.Join("consumer"));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (Sessions().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_FALSE(Sessions().empty());
  daemon_->process().Kill(SIGTERM);
  const absl::Time sent = absl::Now();
  EXPECT_EQ(daemon_->process().Wait(absl::Seconds(5)), 0) << daemon_->process().Stderr();
  EXPECT_LT(absl::Now() - sent, absl::Seconds(5));
  EXPECT_EQ(consumer.Wait(absl::Seconds(10)), 1);
  EXPECT_THAT(consumer.Stderr(), HasSubstr("UNAVAILABLE"));
  EXPECT_THAT(daemon_->process().Stderr(), HasSubstr("received SIGTERM"));
}

// A dataset that shrinks underneath ends the session with DATA_LOSS, never SIGBUS, with
// either read mode.
class ShrinkTest : public DaemonTest, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    tokens_path_ = dir_.Join("tokens.bin");
    tokens_ = WriteTokens(tokens_path_, kTokens);
    daemon_ = std::make_unique<Daemon>(dir_, std::vector<std::string>{"--read_mode=" + GetParam()});
    ASSERT_TRUE(daemon_->ready()) << daemon_->process().Stderr();
  }
};

INSTANTIATE_TEST_SUITE_P(ReadModes, ShrinkTest, ::testing::Values("mmap", "pread"));

TEST_P(ShrinkTest, ShrunkenDatasetIsDataLossNotACrash) {
  const std::string path = dir_.Join("shrinking.bin");
  WriteTokens(path, kTokens);
  Subprocess consumer(CtlArgv(daemon_->socket(),
                              {"consume", "--dataset", path, "--seq-len", "16", "--batch-size",
                               "8", "--epochs", "0", "--max-batches", "100000000", "--step-ms",
                               "5", "--no-shuffle"}),
                      dir_.Join("shrink"));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (Sessions().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  ASSERT_EQ(::truncate(path.c_str(), 1000), 0);
  EXPECT_EQ(consumer.Wait(absl::Seconds(20)), 1);
  EXPECT_THAT(consumer.Stderr(), HasSubstr("DATA_LOSS"));
  EXPECT_THAT(consumer.Stderr(), HasSubstr("shrank"));
  EXPECT_TRUE(daemon_->process().Running());
  // And it goes on serving others.
  CtlResult after = RunCtl(daemon_->socket(), Consume({"--batch-size", "8", "--max-batches", "2"}),
                           dir_.Join("after"));
  EXPECT_EQ(after.exit_code, 0) << after.err;
}

// The C ABI, from a program compiled as C.
TEST_F(DaemonTest, CApiProgram) {
  // And a WebDataset whose key img.001 is key img without an image: its notice.
  const std::string shards = dir_.Join("wds");
  std::filesystem::create_directories(shards);
  const std::vector<uint8_t> png = EncodePng(Picture(6, 7, 3, 1), 6, 7);
  const std::string image(png.begin(), png.end());
  std::ofstream(shards + "/train-0.tar", std::ios::binary)
      << TarFile("a.cls", "0") + TarFile("a.png", image) + TarFile("img.001.cls", "1") +
             TarFile("img.001.jpg", image) + TarEnd();
  Subprocess c({C_API_TEST_PATH, daemon_->socket(), tokens_path_, shards}, dir_.Join("c"));
  EXPECT_EQ(c.Wait(), 0) << c.Stdout() << c.Stderr();
  EXPECT_THAT(c.Stdout(), HasSubstr("c api ok"));
}

}  // namespace
}  // namespace gpufeed::testing
