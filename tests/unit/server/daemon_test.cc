// The daemon in-process (tests/testing/test_daemon.h): the stream reactor, the memory socket,
// drain and config through the real server::Daemon, its gRPC socket and the client library.
#include "server/daemon.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gpufeed/client.h"
#include "gpufeed/v1/feed.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "gtest/gtest.h"
#include "server/config.h"
#include "server/service/feed_service.h"
#include "tests/testing/eventually.h"
#include "tests/testing/fake_clock.h"
#include "tests/testing/fake_device_backend.h"
#include "tests/testing/fake_file_system.h"
#include "tests/testing/load_config.h"
#include "tests/testing/test_daemon.h"
#include "tests/testing/wrapping_file_system.h"

namespace gpufeed::server {
namespace {

using ::gpufeed::testing::Eventually;
using ::gpufeed::testing::FakeClock;
using ::gpufeed::testing::FakeDeviceBackend;
using ::gpufeed::testing::FakeFileSystem;
using ::gpufeed::testing::TestDaemon;
using ::gpufeed::testing::TestDaemonOptions;

constexpr int64_t kSeqLen = 10;
constexpr int64_t kTokens = 1001;  // (1001 - 1) / 10 = 100 samples

// Counts the daemon's opens: it reads datasets through the file system it was given.
class CountingFileSystem final : public testing::WrappingFileSystem {
 public:
  CountingFileSystem() : WrappingFileSystem(PosixFileSystem()) {}
  int opens() const { return opens_.load(); }

 private:
  void OnOpen() override { opens_.fetch_add(1); }
  std::atomic<int> opens_{0};
};

class InProcessDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TestDaemonOptions options;
    options.fs = &fs_;
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(std::move(options));
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    std::string bytes;
    for (int64_t t = 0; t < kTokens; ++t) {
      const uint16_t v = static_cast<uint16_t>(t * 40503u + 11u);
      tokens_.push_back(v);
      bytes += static_cast<char>(v & 0xff);
      bytes += static_cast<char>(v >> 8);
    }
    path_ = daemon_->dir().WriteFile("tokens.bin", bytes);
  }

  // Job "unit", batch 4 of 100 samples in file order, 2 slots.
  client::AttachOptions Options(const std::string& job = "unit") const {
    client::AttachOptions o;
    o.job = job;
    o.kind = "tokens";
    o.dataset = path_;
    o.token_dtype = "uint16";
    o.seq_len = kSeqLen;
    o.batch_size = 4;
    o.shuffle = false;
    o.ring_slots = 2;
    return o;
  }

  // The same as an AttachRequest, by path (in-process the caller is an admin).
  v1::AttachRequest Request(const std::string& job = "raw") const {
    v1::AttachRequest r;
    r.set_job(job);
    r.set_world_size(1);
    r.mutable_dataset()->set_kind(v1::DATASET_KIND_TOKENS);
    r.mutable_dataset()->set_path(path_);
    r.mutable_dataset()->set_token_dtype(v1::DTYPE_UINT16);
    r.mutable_dataset()->set_seq_len(kSeqLen);
    r.set_batch_size(4);
    r.set_shuffle(false);
    r.set_ring_slots(2);
    return r;
  }

  // Request() through the daemon's Feed service itself, without the client library.
  void AttachRaw(v1::Feed::Stub* feed, v1::AttachResponse* attached) const {
    grpc::ClientContext ctx;
    grpc::Status s = feed->Attach(&ctx, Request(), attached);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  std::vector<client::SessionSummary> Sessions() const {
    absl::StatusOr<std::unique_ptr<client::AdminClient>> admin = daemon_->Admin();
    EXPECT_TRUE(admin.ok()) << admin.status();
    if (!admin.ok()) return {};
    absl::StatusOr<std::vector<client::SessionSummary>> s = (*admin)->ListSessions();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : std::vector<client::SessionSummary>{};
  }

  // Expects row r of `batch` (tensor "tokens") to be sample `id`'s bytes in the file.
  void ExpectRow(const client::Batch& batch, int64_t r, int64_t id) const {
    const client::Tensor* t = batch.tensor("tokens");
    ASSERT_NE(t, nullptr);
    const auto* row = static_cast<const uint16_t*>(t->data) + r * (kSeqLen + 1);
    EXPECT_EQ(std::memcmp(row, &tokens_[static_cast<size_t>(id * kSeqLen)], (kSeqLen + 1) * 2),
              0)
        << "row " << r << " (sample " << id << ") of step " << batch.step();
  }

  // Another daemon, reading through `fs` (which must outlive it); null, and a failure, when it
  // did not start.
  static std::unique_ptr<TestDaemon> StartReadingThrough(FileSystem* fs) {
    TestDaemonOptions options;
    options.fs = fs;
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(std::move(options));
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *std::move(d) : nullptr;
  }

  CountingFileSystem fs_;  // outlives the daemon
  std::unique_ptr<TestDaemon> daemon_;
  std::vector<uint16_t> tokens_;
  std::string path_;
};

// ---- the stream reactor ----

TEST_F(InProcessDaemonTest, TheStreamDeliversEveryBatchInOrderByteExact) {
  client::AttachOptions o = Options();
  o.stop_epoch = 1;
  absl::StatusOr<std::unique_ptr<client::Session>> session = daemon_->Attach(o);
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->info().num_samples, 100);
  EXPECT_EQ((*session)->info().steps_per_epoch, 25);
  int64_t step = 0;
  while (true) {
    absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(10));
    if (absl::IsOutOfRange(batch.status())) break;  // EndOfData at stop_epoch
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_EQ(batch->epoch(), 0);
    ASSERT_EQ(batch->step(), step);
    EXPECT_EQ(batch->valid_count(), 4);
    ASSERT_EQ(batch->ids(), (std::vector<int64_t>{4 * step, 4 * step + 1, 4 * step + 2,
                                                  4 * step + 3}));
    const client::Tensor* t = batch->tensor("tokens");
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, DType::kUInt16);
    EXPECT_EQ(t->shape, (std::vector<int64_t>{4, kSeqLen + 1}));
    EXPECT_EQ(t->byte_size, uint64_t{4 * (kSeqLen + 1) * 2});
    for (int64_t r = 0; r < 4; ++r) ExpectRow(*batch, r, 4 * step + r);
    ++step;
  }
  EXPECT_EQ(step, 25);
  EXPECT_EQ((*session)->position().epoch, 1);
  EXPECT_EQ((*session)->position().step, 0);
  EXPECT_EQ((*session)->rejected_releases(), 0);
  // The daemon read the dataset through the file system it was given.
  EXPECT_GE(fs_.opens(), 1);
}

TEST_F(InProcessDaemonTest, AReleaseOfAWrongGenerationIsRejectedAndTheSessionGoesOn) {
  std::unique_ptr<v1::Feed::Stub> feed = v1::Feed::NewStub(daemon_->Channel());
  v1::AttachResponse attached;
  ASSERT_NO_FATAL_FAILURE(AttachRaw(feed.get(), &attached));
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream =
      feed->Stream(&ctx);
  v1::StreamRequest open;
  open.mutable_open()->set_session_id(attached.session_id());
  open.mutable_open()->set_token(attached.token());
  ASSERT_TRUE(stream->Write(open));
  // Both slots' batches, steps 0 and 1, in order.
  std::vector<v1::BatchReady> batches;
  while (batches.size() < 2) {
    v1::StreamResponse response;
    ASSERT_TRUE(stream->Read(&response));
    for (const v1::BatchReady& b : response.batches()) batches.push_back(b);
  }
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[0].step(), 0);
  EXPECT_EQ(batches[1].step(), 1);
  EXPECT_THAT(batches[0].ids(), ::testing::ElementsAre(0, 1, 2, 3));

  v1::StreamRequest bad;
  v1::Release* release = bad.add_releases();
  release->set_slot(batches[0].slot());
  release->set_generation(batches[0].generation() + 1);
  ASSERT_TRUE(stream->Write(bad));
  v1::StreamResponse rejected;
  ASSERT_TRUE(stream->Read(&rejected));
  EXPECT_EQ(rejected.batches_size(), 0);
  ASSERT_EQ(rejected.rejected_size(), 1);
  EXPECT_EQ(rejected.rejected(0).slot(), batches[0].slot());
  EXPECT_EQ(rejected.rejected(0).generation(), batches[0].generation() + 1);
  EXPECT_EQ(rejected.rejected(0).code(), static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(rejected.rejected(0).message(),
            absl::StrCat("release of slot ", batches[0].slot(), " generation ",
                         batches[0].generation() + 1,
                         ": stale generation, the slot holds generation ",
                         batches[0].generation()));

  // The session goes on: the right release brings step 2 in that slot.
  v1::StreamRequest good;
  release = good.add_releases();
  release->set_slot(batches[0].slot());
  release->set_generation(batches[0].generation());
  ASSERT_TRUE(stream->Write(good));
  v1::StreamResponse next;
  ASSERT_TRUE(stream->Read(&next));
  ASSERT_EQ(next.batches_size(), 1);
  EXPECT_EQ(next.batches(0).step(), 2);
  EXPECT_EQ(next.batches(0).slot(), batches[0].slot());
  EXPECT_THAT(next.batches(0).ids(), ::testing::ElementsAre(8, 9, 10, 11));
  ctx.TryCancel();
}

TEST_F(InProcessDaemonTest, AStreamCancelledByTheClientEndsItsSession) {
  std::unique_ptr<v1::Feed::Stub> feed = v1::Feed::NewStub(daemon_->Channel());
  v1::AttachResponse attached;
  ASSERT_NO_FATAL_FAILURE(AttachRaw(feed.get(), &attached));
  ASSERT_EQ(Sessions().size(), 1u);
  {
    grpc::ClientContext ctx;
    auto stream = feed->Stream(&ctx);
    v1::StreamRequest open;
    open.mutable_open()->set_session_id(attached.session_id());
    open.mutable_open()->set_token(attached.token());
    ASSERT_TRUE(stream->Write(open));
    v1::StreamResponse response;
    ASSERT_TRUE(stream->Read(&response));
    ASSERT_GE(response.batches_size(), 1);
    ASSERT_TRUE(Eventually([&] {
      std::vector<client::SessionSummary> s = Sessions();
      return s.size() == 1 && s[0].streaming;
    }));
    ctx.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  EXPECT_TRUE(Eventually([&] { return Sessions().empty(); }));
  // Its ring went back to the pool.
  absl::StatusOr<std::unique_ptr<client::AdminClient>> admin = daemon_->Admin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_TRUE(Eventually([&] {
    absl::StatusOr<client::DaemonStatus> st = (*admin)->GetStatus();
    return st.ok() && st->staging_free_bytes == st->staging_total_bytes;
  }));
}

// ---- injected clock and device backend ----

// Opens the stream of `attached` (device: one release event per slot).
std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> OpenStream(
    v1::Feed::Stub& feed, grpc::ClientContext* ctx, const v1::AttachResponse& attached,
    int release_events = 0) {
  auto stream = feed.Stream(ctx);
  v1::StreamRequest open;
  open.mutable_open()->set_session_id(attached.session_id());
  open.mutable_open()->set_token(attached.token());
  for (int i = 0; i < release_events; ++i) {
    open.mutable_open()->add_release_event_handles(std::string(64, 'r'));
  }
  EXPECT_TRUE(stream->Write(open));
  return stream;
}

TEST_F(InProcessDaemonTest, TheInjectedClockEndsAnUnstreamedSessionAndADrainAtItsTimeout) {
  FakeClock clock;  // outlives the daemon
  TestDaemonOptions options;
  options.clock = clock.AsClock();
  options.configure = [](DaemonConfig& c) {
    c.attach_timeout = absl::Minutes(10);
    c.idle_lease_timeout = absl::ZeroDuration();  // the eager consumer holds its whole ring
  };
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(std::move(options));
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<v1::Feed::Stub> feed = v1::Feed::NewStub((*d)->Channel());
  v1::AttachResponse lazy, eager;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(feed->Attach(&ctx, Request("lazy"), &lazy).ok());
  }
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(feed->Attach(&ctx, Request("eager"), &eager).ok());
  }
  grpc::ClientContext stream_ctx;
  auto stream = OpenStream(*feed, &stream_ctx, eager);
  // Its whole ring (2 slots) delivered and held: no fill of it is running when the clock
  // jumps (one would pass max_batch_time on that clock and end it too).
  for (int batches = 0; batches < 2;) {
    v1::StreamResponse response;
    ASSERT_TRUE(stream->Read(&response));
    batches += response.batches_size();
  }
  auto admin = (*d)->Admin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  auto sessions = [&] {
    absl::StatusOr<std::vector<client::SessionSummary>> s = (*admin)->ListSessions();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? s->size() : size_t{0};
  };
  EXPECT_EQ(sessions(), 2u);
  // Ten minutes of the daemon's clock, in no time: the session without a stream is ended.
  clock.Advance(absl::Minutes(10) + absl::Nanoseconds(1));
  ASSERT_TRUE(Eventually([&] { return sessions() == 1; }));
  absl::StatusOr<std::vector<client::SessionSummary>> left = (*admin)->ListSessions();
  ASSERT_TRUE(left.ok());
  ASSERT_EQ(left->size(), 1u);
  EXPECT_EQ((*left)[0].session_id, eager.session_id());

  // A drain with a timeout ends when that clock passes it, the session still attached.
  absl::StatusOr<int32_t> drained = (*admin)->Drain(absl::Hours(1));
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(*drained, 1);
  EXPECT_TRUE((*d)->stop_requests().empty());
  clock.Advance(absl::Hours(1));
  ASSERT_TRUE((*d)->WaitForStopRequest(Daemon::StopReason::kDrained));
  EXPECT_EQ(sessions(), 1u);
  stream_ctx.TryCancel();
  (*d)->Stop();
}

TEST_F(InProcessDaemonTest, AnInjectedDeviceBackendServesDeviceDelivery) {
  auto backend = std::make_unique<FakeDeviceBackend>(uint64_t{64} << 20);
  FakeDeviceBackend* fake = backend.get();
  TestDaemonOptions options;
  options.devices = std::move(backend);
  absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start(std::move(options));
  ASSERT_TRUE(d.ok()) << d.status();
  std::unique_ptr<v1::Feed::Stub> feed = v1::Feed::NewStub((*d)->Channel());
  v1::AttachRequest request = Request("device");
  request.mutable_delivery()->set_kind(v1::DELIVERY_KIND_DEVICE);
  request.mutable_delivery()->set_gpu_uuid("GPU-fake");
  v1::AttachResponse attached;
  {
    grpc::ClientContext ctx;
    grpc::Status s = feed->Attach(&ctx, request, &attached);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(attached.device().legacy_mem_handle(), std::string(64, 'm'));
  grpc::ClientContext ctx;
  auto stream = OpenStream(*feed, &ctx, attached, /*release_events=*/2);
  std::vector<v1::BatchReady> batches;
  while (batches.size() < 2) {
    v1::StreamResponse response;
    ASSERT_TRUE(stream->Read(&response));
    for (const v1::BatchReady& b : response.batches()) batches.push_back(b);
  }
  ASSERT_NE(fake->last, nullptr);
  for (int64_t step = 0; step < 2; ++step) {
    const v1::BatchReady& b = batches[static_cast<size_t>(step)];
    EXPECT_EQ(b.step(), step);
    // The slot's bytes in the (fake) GPU ring are the file's rows.
    const auto* rows = reinterpret_cast<const uint16_t*>(fake->last->slot_data(b.slot()));
    for (int64_t r = 0; r < 4; ++r) {
      EXPECT_EQ(std::memcmp(rows + r * (kSeqLen + 1),
                            &tokens_[static_cast<size_t>((4 * step + r) * kSeqLen)],
                            (kSeqLen + 1) * 2),
                0)
          << "row " << r << " of step " << step;
    }
  }
  // The stream's release events reach the ring on the copy thread, which may run after the
  // first batches are out: poll for them (a plain check here failed 1 run in ~14 under load).
  EXPECT_TRUE(Eventually([&] {
    for (const std::string& call : fake->log->Calls()) {
      if (call == "release-events 2") return true;
    }
    return false;
  })) << ::testing::PrintToString(fake->log->Calls());
  ctx.TryCancel();
  (*d)->Stop();
}

TEST_F(InProcessDaemonTest, AnInjectedFileSystemIsWhatTheDaemonReads) {
  FakeFileSystem fs;  // outlives the daemon
  std::unique_ptr<TestDaemon> d = StartReadingThrough(&fs);
  ASSERT_NE(d, nullptr);
  // The client opens the real file (its rights); the daemon reads the fake's bytes for it.
  // Other tokens than on disk, so a row shows which one was read.
  std::vector<uint16_t> fake_tokens = tokens_;
  for (uint16_t& t : fake_tokens) t = static_cast<uint16_t>(t + 1);
  std::string bytes(static_cast<size_t>(kTokens) * 2, '\0');
  std::memcpy(bytes.data(), fake_tokens.data(), bytes.size());
  fs.AddFile(path_, bytes);
  client::AttachOptions o = Options();
  o.ring_slots = 2;
  absl::StatusOr<std::unique_ptr<client::Session>> session = d->Attach(o);
  ASSERT_TRUE(session.ok()) << session.status();
  {
    absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(10));
    ASSERT_TRUE(batch.ok()) << batch.status();
    const client::Tensor* t = batch->tensor("tokens");
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(std::memcmp(t->data, fake_tokens.data(), (kSeqLen + 1) * 2), 0);  // row 0
  }
  // The fake file shrinks under the session: a later fill fails and ends it with DATA_LOSS.
  fs.Shrink(path_, 100);
  absl::Status ended;
  for (int i = 0; i < 30 && ended.ok(); ++i) {
    absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(10));
    ended = batch.status();
  }
  EXPECT_EQ(ended.code(), absl::StatusCode::kDataLoss) << ended;
}

// ---- the memory socket ----

// The mapping of this process that holds `p`: [start, end) and its path, from /proc/self/maps.
struct Mapping {
  uintptr_t start = 0, end = 0;
  std::string path;
};
Mapping MappingOf(const void* p) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto addr = reinterpret_cast<uintptr_t>(p);
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms, offset, dev, inode, path;
    in >> range >> perms >> offset >> dev >> inode;
    std::getline(in >> std::ws, path);
    const std::vector<std::string> ends = absl::StrSplit(range, '-');
    Mapping m{std::stoull(ends[0], nullptr, 16), std::stoull(ends[1], nullptr, 16), path};
    if (m.start <= addr && addr < m.end) return m;
  }
  return {};
}

TEST_F(InProcessDaemonTest, AHostSessionMapsExactlyItsRing) {
  absl::StatusOr<std::unique_ptr<client::Session>> session = daemon_->Attach(Options());
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<client::SessionSummary> sessions = Sessions();
  ASSERT_EQ(sessions.size(), 1u);
  const uint64_t ring_bytes = sessions[0].ring_bytes;
  const uint64_t stride = (*session)->info().slot_stride_bytes;
  EXPECT_EQ(ring_bytes % 4096, 0u);
  EXPECT_GE(ring_bytes, 2 * stride);
  EXPECT_LT(ring_bytes, 2 * stride + 4096);

  absl::StatusOr<client::Batch> first = (*session)->Next(absl::Seconds(10));
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<client::Batch> second = (*session)->Next(absl::Seconds(10));
  ASSERT_TRUE(second.ok()) << second.status();
  const void* a = first->tensor("tokens")->data;
  const void* b = second->tensor("tokens")->data;
  // Both slots lie in one mapping: the ring's own memfd, exactly the ring's bytes, read-only.
  const Mapping m = MappingOf(a);
  EXPECT_EQ(m.path.rfind("/memfd:gpufeed-ring", 0), 0u) << m.path;
  EXPECT_EQ(m.end - m.start, ring_bytes);
  const Mapping mb = MappingOf(b);
  EXPECT_EQ(mb.start, m.start);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) - m.start, first->slot() * stride);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) - m.start, second->slot() * stride);
  ExpectRow(*first, 0, 0);
  ExpectRow(*second, 3, 7);
}

// ---- drain ----

TEST_F(InProcessDaemonTest, ADrainRefusesNewSessionsServesRunningOnesAndEndsWithTheLast) {
  absl::StatusOr<std::unique_ptr<client::Session>> a = daemon_->Attach(Options("a"));
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<std::unique_ptr<client::Session>> b = daemon_->Attach(Options("b"));
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<std::unique_ptr<client::AdminClient>> admin = daemon_->Admin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  absl::StatusOr<int32_t> drained = (*admin)->Drain(absl::ZeroDuration());
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(*drained, 2);
  absl::StatusOr<client::DaemonStatus> status = (*admin)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status->draining);
  EXPECT_EQ(status->health, "NOT_SERVING");

  absl::StatusOr<std::unique_ptr<client::Session>> refused = daemon_->Attach(Options("c"));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_THAT(refused.status().message(), ::testing::HasSubstr("draining"));

  // The running sessions go on.
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<client::Batch> batch = (*a)->Next(absl::Seconds(10));
    ASSERT_TRUE(batch.ok()) << batch.status();
    EXPECT_EQ(batch->step(), i);
  }
  ASSERT_TRUE((*a)->Detach().ok());
  ASSERT_TRUE(Eventually([&] { return Sessions().size() == 1; }));
  absl::StatusOr<client::Batch> batch = (*b)->Next(absl::Seconds(10));
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(daemon_->stop_requests().empty());  // one session still runs
  // The last one leaves: the drain ends and the daemon asks to be stopped. A session whose
  // batch is still held detaches only once it is released (the batch keeps its bytes).
  ASSERT_TRUE((*b)->Detach().ok());
  EXPECT_EQ(Sessions().size(), 1u);
  EXPECT_TRUE(daemon_->stop_requests().empty());
  batch->Release();
  ASSERT_TRUE(daemon_->WaitForStopRequest(Daemon::StopReason::kDrained));
  EXPECT_EQ(daemon_->stop_requests(),
            std::vector<Daemon::StopReason>{Daemon::StopReason::kDrained});
  daemon_->Stop();
}

// ---- races fixed in dbe29e1, in short loops ----

// A stream cancelled while its session is filling the slot just released: the session's
// notification (Kick) runs while the reactor finishes (OnDone). Every stream ends CANCELLED,
// every session goes and every ring returns (under ASan: no use of a deleted reactor).
TEST_F(InProcessDaemonTest, StreamsCancelledWhileTheirBatchesAreFilledEndCleanly) {
  std::unique_ptr<v1::Feed::Stub> feed = v1::Feed::NewStub(daemon_->Channel());
  for (int i = 0; i < 200; ++i) {
    // A job of its own each time: the session before may still be ending (OnDone runs after
    // the client saw CANCELLED).
    v1::AttachResponse attached;
    {
      grpc::ClientContext ctx;
      grpc::Status s = feed->Attach(&ctx, Request(absl::StrCat("cancel-", i)), &attached);
      ASSERT_TRUE(s.ok()) << "iteration " << i << ": " << s.error_message();
    }
    grpc::ClientContext ctx;
    auto stream = OpenStream(*feed, &ctx, attached);
    v1::StreamResponse response;
    ASSERT_TRUE(stream->Read(&response)) << "iteration " << i;
    ASSERT_GE(response.batches_size(), 1);
    // Release every batch delivered (the fill threads refill those slots and notify the
    // stream) and cancel at once.
    v1::StreamRequest release;
    for (const v1::BatchReady& b : response.batches()) {
      v1::Release* r = release.add_releases();
      r->set_slot(b.slot());
      r->set_generation(b.generation());
    }
    ASSERT_TRUE(stream->Write(release));
    ctx.TryCancel();
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED) << "iteration " << i;
  }
  EXPECT_TRUE(Eventually([&] { return Sessions().empty(); }, absl::Seconds(10)))
      << Sessions().size() << " sessions left";
  absl::StatusOr<std::unique_ptr<client::AdminClient>> admin = daemon_->Admin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_TRUE(Eventually([&] {
    absl::StatusOr<client::DaemonStatus> st = (*admin)->GetStatus();
    return st.ok() && st->staging_free_bytes == st->staging_total_bytes;
  }));
}

// The Kick/OnDone race of dbe29e1, made to happen every time (the loop above catches it only
// now and then under ASan): a session notification's Kick is held inside its claim on the
// reactor (StreamTestHooks) while the consumer cancels and the stream ends. OnDone must then
// leave the reactor to that Kick, which steps it and deletes it after; with the fix undone,
// the Kick steps a deleted reactor (a heap-use-after-free under ASan).
TEST_F(InProcessDaemonTest, AKickHeldInsideTheReactorWhileTheStreamEndsStepsItBeforeItGoes) {
  std::unique_ptr<v1::Feed::Stub> feed = v1::Feed::NewStub(daemon_->Channel());
  v1::AttachResponse attached;
  {
    grpc::ClientContext ctx;
    grpc::Status s = feed->Attach(&ctx, Request("held-kick"), &attached);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  grpc::ClientContext ctx;
  auto stream = OpenStream(*feed, &ctx, attached);
  v1::StreamResponse response;
  ASSERT_TRUE(stream->Read(&response));
  ASSERT_GE(response.batches_size(), 1);

  // Shared with the hooks, which stay installed (disarmed at the end): replacing a
  // std::function that a daemon thread may be calling would race it.
  struct Held {
    absl::Notification inside, go, done;
    std::atomic<bool> armed{true};
    std::atomic<bool> stepped_after_done{false};
  };
  auto held = std::make_shared<Held>();
  StreamTestHooks& hooks = TestHooksOfStreams();
  hooks.kick_before_step = [held] {
    if (!held->armed.exchange(false)) return;  // the first Kick only
    held->inside.Notify();
    held->go.WaitForNotificationWithTimeout(absl::Seconds(20));
    held->stepped_after_done = held->done.HasBeenNotified();
  };
  hooks.on_done = [held] {
    if (!held->done.HasBeenNotified()) held->done.Notify();
  };
  struct Release {  // a failed assertion below must not leave the Kick held
    std::shared_ptr<Held> held;
    ~Release() {
      held->armed = false;
      if (!held->go.HasBeenNotified()) held->go.Notify();
    }
  } release_on_exit{held};
  // A release: the fill threads refill the slot and notify the stream, whose Kick is held.
  v1::StreamRequest release;
  release.add_releases()->set_slot(response.batches(0).slot());
  release.mutable_releases(0)->set_generation(response.batches(0).generation());
  ASSERT_TRUE(stream->Write(release));
  ASSERT_TRUE(held->inside.WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "no session notification reached the stream";
  ctx.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(held->done.WaitForNotificationWithTimeout(absl::Seconds(10))) << "OnDone never ran";
  held->go.Notify();  // the held Kick now steps the reactor OnDone has left to it
  EXPECT_TRUE(Eventually([&] { return Sessions().empty(); }, absl::Seconds(10)))
      << Sessions().size() << " sessions left";
  EXPECT_TRUE(Eventually([&] { return held->stepped_after_done.load(); }, absl::Seconds(10)));
}

// Attach and detach in a loop, from two threads at once: each Attach is OK, each Detach OK,
// and no session is left behind.
TEST_F(InProcessDaemonTest, AttachDetachLoopsFromTwoThreadsLeaveNoSession) {
  std::atomic<int> attached{0};
  auto loop = [&](const std::string& job) {
    for (int i = 0; i < 50; ++i) {
      absl::StatusOr<std::unique_ptr<client::Session>> s = daemon_->Attach(Options(job));
      ASSERT_TRUE(s.ok()) << job << " " << i << ": " << s.status();
      if (i % 2 == 0) {  // every other one with a batch taken and released first
        absl::StatusOr<client::Batch> batch = (*s)->Next(absl::Seconds(10));
        ASSERT_TRUE(batch.ok()) << batch.status();
      }
      ASSERT_TRUE((*s)->Detach().ok()) << job << " " << i;
      ++attached;
    }
  };
  std::thread other([&] { loop("loop-a"); });
  loop("loop-b");
  other.join();
  EXPECT_EQ(attached.load(), 100);
  EXPECT_TRUE(Eventually([&] { return Sessions().empty(); }, absl::Seconds(10)))
      << Sessions().size() << " sessions left";
}

// A drain asked for once the shutdown began starts nothing: it reports the sessions, its
// callback never runs, and the daemon is destroyed cleanly (a watcher started after the
// shutdown joined the last one was left running into ~Daemon: std::terminate).
TEST_F(InProcessDaemonTest, ADrainAfterTheShutdownBeganStartsNoWatcher) {
  for (int i = 0; i < 5; ++i) {
    absl::StatusOr<std::unique_ptr<TestDaemon>> d = TestDaemon::Start();
    ASSERT_TRUE(d.ok()) << d.status();
    std::atomic<bool> ran{false};
    Daemon* daemon = (*d)->daemon();
    if (i == 0) {
      daemon->Shutdown();  // strictly before
      EXPECT_EQ(daemon->Drain(absl::ZeroDuration(), [&] { ran = true; }), 0);
    } else {  // racing it
      std::thread drain([&] { daemon->Drain(absl::ZeroDuration(), [&] { ran = true; }); });
      daemon->Shutdown();
      drain.join();
    }
    (*d)->Stop();  // destroys the daemon
    if (i == 0) {
      EXPECT_FALSE(ran.load());
    }
  }
}

// An Attach whose dataset open is under way when a drain begins is refused naming the drain,
// not admitted after the drain counted no sessions (Attach checks the drain again once the
// dataset is open).
class GatedFileSystem final : public testing::WrappingFileSystem {
 public:
  GatedFileSystem() : WrappingFileSystem(PosixFileSystem()) {}
  std::atomic<bool> armed{false};  // from then on, opens wait for `open`
  absl::Notification entered, open;

 private:
  void OnOpen() override {
    if (!armed.load()) return;
    if (!entered.HasBeenNotified()) entered.Notify();
    open.WaitForNotification();
  }
};

TEST_F(InProcessDaemonTest, AnAttachOpeningItsDatasetWhenADrainBeginsIsRefused) {
  GatedFileSystem fs;  // outlives the daemon
  std::unique_ptr<TestDaemon> d = StartReadingThrough(&fs);
  ASSERT_NE(d, nullptr);
  absl::StatusOr<std::unique_ptr<client::Session>> late = absl::UnknownError("not attached");
  fs.armed = true;
  std::thread attach([&] { late = d->Attach(Options("late")); });
  ASSERT_TRUE(fs.entered.WaitForNotificationWithTimeout(absl::Seconds(10)));
  auto admin = d->Admin();
  ASSERT_TRUE(admin.ok()) << admin.status();
  absl::StatusOr<int32_t> drained = (*admin)->Drain(absl::ZeroDuration());
  fs.open.Notify();
  attach.join();
  ASSERT_TRUE(drained.ok()) << drained.status();
  EXPECT_EQ(*drained, 0);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable) << late.status();
  EXPECT_THAT(late.status().message(), ::testing::HasSubstr("draining"));
  absl::StatusOr<std::vector<client::SessionSummary>> left = (*admin)->ListSessions();
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->empty());
  d->Stop();
}

// ---- config ----

absl::StatusOr<DaemonConfig> Load(std::vector<std::string> args) {
  return ::gpufeed::testing::LoadConfigFromArgs(std::move(args));
}

TEST_F(InProcessDaemonTest, AConfigFileStartsADaemonThatServesOnItsSockets) {
  const std::string dir = daemon_->dir().path();
  const std::string file = daemon_->dir().WriteFile(
      "gpufeedd.textproto", absl::StrCat("listen: \"unix://", dir, "/other.sock\"\n",
                                         "staging_bytes: 16777216\n",
                                         "staging_slab_bytes: 16777216\n", "threads: 1\n"));
  absl::StatusOr<DaemonConfig> config = Load({"--config=" + file});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->mem_socket, dir + "/other.mem.sock");
  absl::StatusOr<std::unique_ptr<TestDaemon>> other =
      TestDaemon::Start(*std::move(config), TestDaemonOptions{});
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ((*other)->socket_path(), dir + "/other.sock");
  client::AttachOptions o = Options();
  absl::StatusOr<std::unique_ptr<client::Session>> session = (*other)->Attach(o);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<client::Batch> batch = (*session)->Next(absl::Seconds(10));
  ASSERT_TRUE(batch.ok()) << batch.status();
  ExpectRow(*batch, 0, 0);
  absl::StatusOr<std::unique_ptr<client::AdminClient>> admin = (*other)->Admin();
  ASSERT_TRUE(admin.ok());
  absl::StatusOr<client::DaemonStatus> status = (*admin)->GetStatus();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->staging_total_bytes, uint64_t{16} << 20);
}

TEST_F(InProcessDaemonTest, AConfigFileWithABadSocketDirectoryFailsToStartNamingIt) {
  const std::string dir = daemon_->dir().path();
  const std::string missing = dir + "/no/such/dir/gpufeed.sock";
  const std::string file = daemon_->dir().WriteFile(
      "bad.textproto", absl::StrCat("listen: \"unix://", missing, "\"\n"));
  absl::StatusOr<DaemonConfig> config = Load({"--config=" + file});
  ASSERT_TRUE(config.ok()) << config.status();  // a path is not checked before Start
  absl::StatusOr<std::unique_ptr<TestDaemon>> refused =
      TestDaemon::Start(*std::move(config), TestDaemonOptions{});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
  EXPECT_EQ(refused.status().message(),
            absl::StrCat("listen: binding ", missing, ": No such file or directory"));
  // The daemon under test is not disturbed.
  EXPECT_TRUE(daemon_->Attach(Options()).ok());
}

}  // namespace
}  // namespace gpufeed::server
