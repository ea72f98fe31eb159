// The device acts only on staged records checked against their slot (docs/SECURITY.md
// section 3): each way a record can point outside the slot's arena or the ring's scratch, or
// read outside its source, is a clean INTERNAL error for the batch; good records pass; the
// records used are a copy, so a later write to the slot cannot change what was checked.
#include "server/device/staged_records.h"

#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_device_backend.h"
#include "tests/testing/image_files.h"

namespace gpufeed::server {
namespace {

using ::testing::HasSubstr;

constexpr int kBatch = 3;
constexpr int kOut = 8;  // 8 x 8 uint8 output images

class StagedRecordsTest : public ::testing::Test {
 protected:
  StagedRecordsTest() : layout_(MakeStagedLayout(kBatch, OutputSpec{}, kOut, kOut)) {
    output_.image_offset = 0;
    output_.image_row_bytes = layout_.final_row_bytes;
    output_.label_offset = kBatch * output_.image_row_bytes;
    slot_.assign(layout_.stride_bytes, std::byte{0});
    // Row 0 finished on the CPU, row 1 raw pixels (a 4 x 5 crop), row 2 a "JPEG" of 6 x 7.
    StagedRecord& f = Record(0);
    f.kind = StagedKind::kFinal;
    f.host_offset = 0;
    f.host_bytes = layout_.final_row_bytes;
    StagedRecord& raw = Record(1);
    raw.kind = StagedKind::kRaw;
    raw.geometry = Geometry(4, 5);
    raw.host_offset = 256;
    raw.host_bytes = 4 * 5 * 3;
    raw.device_offset = layout_.device_tasks_bytes;
    raw.device_bytes = 4 * 5 * 3;
    StagedRecord& jpeg = Record(2);
    jpeg.kind = StagedKind::kJpeg;
    jpeg.geometry = Geometry(6, 7);
    jpeg.host_offset = 512;
    jpeg.host_bytes = 100;
    jpeg.device_offset = layout_.device_tasks_bytes + 256;
    jpeg.device_bytes = 6 * 7 * 3;
  }

  static StagedGeometry Geometry(int h, int w) {
    StagedGeometry g;
    g.src_height = h;
    g.src_width = w;
    g.crop_height = h;
    g.crop_width = w;
    g.resize_height = kOut;
    g.resize_width = kOut;
    return g;
  }

  StagedRecord& Record(int row) {
    return reinterpret_cast<StagedRecord*>(slot_.data() + layout_.records_offset)[row];
  }

  absl::StatusOr<std::vector<StagedRecord>> Read(int count = kBatch) {
    return ReadStagedRecords(slot_.data(), layout_, count, output_);
  }

  // The batch with one change to one record is refused, naming the row and the reason.
  void ExpectRefused(int row, const std::function<void(StagedRecord&)>& corrupt,
                     const std::string& reason) {
    const StagedRecord saved = Record(row);
    corrupt(Record(row));
    absl::StatusOr<std::vector<StagedRecord>> r = Read();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << reason;
    EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat("staged batch row ", row, ": ")));
    EXPECT_THAT(r.status().message(), HasSubstr(reason));
    Record(row) = saved;
  }

  StagedLayout layout_;
  StagedOutput output_;
  std::vector<std::byte> slot_;
};

TEST_F(StagedRecordsTest, GoodRecordsPassAndAreACopy) {
  absl::StatusOr<std::vector<StagedRecord>> r = Read();
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[1].kind, StagedKind::kRaw);
  EXPECT_EQ((*r)[2].device_bytes, 6u * 7 * 3);
  // A write to the slot after the check changes nothing the caller uses.
  Record(1).host_offset = ~uint64_t{0};
  EXPECT_EQ((*r)[1].host_offset, 256u);
  // The last byte of the arena and of the scratch are in bounds.
  Record(1).host_offset = layout_.arena_bytes - Record(1).host_bytes;
  Record(2).device_offset = layout_.device_scratch_bytes - Record(2).device_bytes;
  Record(0).host_offset = layout_.arena_bytes - layout_.final_row_bytes;
  EXPECT_TRUE(Read().ok()) << Read().status();
  EXPECT_TRUE(Read(0).ok());
}

TEST_F(StagedRecordsTest, ARowCountAboveTheBatchIsRefused) {
  for (int count : {kBatch + 1, -1, 1 << 30}) {
    absl::StatusOr<std::vector<StagedRecord>> r = Read(count);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << count;
    EXPECT_THAT(r.status().message(),
                HasSubstr(absl::StrCat("staged batch of ", count, " rows: the slot holds at most 3")));
  }
}

TEST_F(StagedRecordsTest, RecordsOutsideTheArenaAreRefused) {
  const uint64_t arena = layout_.arena_bytes;
  ExpectRefused(0, [&](StagedRecord& r) { r.host_offset = arena - layout_.final_row_bytes + 1; },
                "finished row outside the slot's arena");
  ExpectRefused(0, [](StagedRecord& r) { r.host_offset = ~uint64_t{0}; },
                "finished row outside the slot's arena");
  ExpectRefused(1, [&](StagedRecord& r) { r.host_offset = arena - r.host_bytes + 1; },
                "sample bytes outside the slot's arena");
  // offset + bytes wraps around 2^64 to a small number: still refused.
  ExpectRefused(2, [](StagedRecord& r) { r.host_bytes = ~uint64_t{0} - r.host_offset + 2; },
                "sample bytes outside the slot's arena");
  ExpectRefused(2, [](StagedRecord& r) { r.host_bytes = 0; }, "sample bytes outside");
}

TEST_F(StagedRecordsTest, RecordsOutsideTheScratchAreRefused) {
  const uint64_t scratch = layout_.device_scratch_bytes;
  ExpectRefused(1, [&](StagedRecord& r) { r.device_offset = scratch - r.device_bytes + 1; },
                "scratch range outside the ring's scratch");
  ExpectRefused(2, [](StagedRecord& r) { r.device_bytes = ~uint64_t{0}; },
                "scratch range outside the ring's scratch");
  // Over the kernel's task area at the scratch's start.
  ExpectRefused(1, [&](StagedRecord& r) { r.device_offset = layout_.device_tasks_bytes - 1; },
                "scratch range outside the ring's scratch");
  ExpectRefused(1, [](StagedRecord& r) { r.host_bytes = r.device_bytes + 1; },
                "raw pixels larger than their scratch range");
}

TEST_F(StagedRecordsTest, GeometryThatReadsOutsideItsSourceIsRefused) {
  ExpectRefused(1, [](StagedRecord& r) { r.geometry.src_height = 5; },
                "source larger than its scratch range");
  ExpectRefused(2, [](StagedRecord& r) { r.geometry.src_width = 0; }, "source size out of range");
  ExpectRefused(2, [](StagedRecord& r) { r.geometry.src_width = 1 << 30; },
                "source size out of range");
  ExpectRefused(2, [](StagedRecord& r) { r.geometry.crop_top = 1; }, "crop outside the source");
  ExpectRefused(2, [](StagedRecord& r) { r.geometry.crop_left = -1; }, "crop outside the source");
  ExpectRefused(2, [](StagedRecord& r) { r.geometry.crop_width = 8; }, "crop outside the source");
  ExpectRefused(2, [](StagedRecord& r) { r.geometry.crop_height = 0; }, "crop outside the source");
  ExpectRefused(1, [](StagedRecord& r) { r.geometry.resize_width = 0; },
                "resize or window out of range");
  ExpectRefused(1, [](StagedRecord& r) { r.geometry.window_top = INT32_MAX; },
                "resize or window out of range");
  ExpectRefused(1, [](StagedRecord& r) { r.geometry.window_left = INT32_MIN; },
                "resize or window out of range");
  ExpectRefused(0, [](StagedRecord& r) { r.kind = static_cast<StagedKind>(7); },
                "unknown record kind");
}

// The fake backend's StageIn, as the CUDA ring's, refuses a corrupted staged slot cleanly
// (under ASan an out-of-bounds read or write here would abort the test).
TEST_F(StagedRecordsTest, TheFakeRingsStageInRefusesACorruptedSlot) {
  auto log = std::make_shared<testing::FakeDeviceLog>();
  testing::FakeDeviceRing ring(log, 1, output_.label_offset + kBatch * sizeof(int64_t),
                               layout_.device_scratch_bytes);
  Record(1).host_offset = uint64_t{1} << 40;
  absl::StatusOr<std::vector<int>> refused =
      ring.StageIn(0, slot_.data(), layout_, kBatch, output_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("staged batch row 1: sample bytes outside the slot's arena"));
  EXPECT_EQ(ring.raws.load(), 0);
  EXPECT_EQ(ring.finals.load(), 0);  // nothing was acted on before the check
  refused = ring.StageIn(0, slot_.data(), layout_, kBatch + 1, output_);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInternal);
}

// nvJPEG writes the file's own size: the fake, as the contract, refuses a JPEG whose size is
// not its record's (here 7 x 6 where the record says 6 x 7: the same bytes, another pitch),
// and hands the row back for the CPU.
TEST_F(StagedRecordsTest, TheFakeRingRefusesAJpegOfAnotherSizeThanItsRecord) {
  for (const auto& [h, w, refused_rows] :
       std::vector<std::tuple<int, int, size_t>>{{6, 7, 0}, {7, 6, 1}}) {
    const std::vector<uint8_t> jpeg =
        testing::EncodeJpeg(testing::Picture(h, w, 3, 1), h, w, TJPF_RGB, TJSAMP_444, 95);
    ASSERT_LE(Record(2).host_offset + jpeg.size(), layout_.arena_bytes);
    std::memcpy(slot_.data() + layout_.arena_offset + Record(2).host_offset, jpeg.data(),
                jpeg.size());
    Record(2).host_bytes = jpeg.size();
    auto log = std::make_shared<testing::FakeDeviceLog>();
    testing::FakeDeviceRing ring(log, 1, output_.label_offset + kBatch * sizeof(int64_t),
                                 layout_.device_scratch_bytes);
    absl::StatusOr<std::vector<int>> refused =
        ring.StageIn(0, slot_.data(), layout_, kBatch, output_);
    ASSERT_TRUE(refused.ok()) << refused.status();
    EXPECT_EQ(refused->size(), refused_rows) << h << " x " << w;
    if (refused_rows > 0) {
      EXPECT_EQ((*refused)[0], 2);
    }
  }
}

}  // namespace
}  // namespace gpufeed::server
