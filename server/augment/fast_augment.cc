// See fast_augment.h. Highway compiles this file once per target (foreach_target.h includes it
// again for each); the tables are built by target-independent code (fast_augment_plan.cc), the
// passes per target.
//
// Per image, two tables: per block of `lanes` output columns and per tap, each lane's crop
// column and weight (the flip and the window folded in: a column outside the resized image
// has no taps, so it is zero); per output row, its first crop row and its weights (none
// outside). Then per output row: the horizontal pass over each crop row it needs (each crop
// row once, kept in a ring of as many lines as a row has taps at most) splits the row's
// channels into planar floats and, per block and tap, picks each lane's input out of a few
// vectors of the channel's line by table lookups (gathers are slow), into planar float lines;
// the vertical pass sums those lines per channel and its sums go through the output stage in
// registers, stored as the layout says. Sums run over the taps in order and never fuse a
// multiply with the add (this file and the tables' are compiled with -ffp-contract=off), which
// makes the result bit-equal to the scalar reference.

#ifndef GPUFEED_SERVER_AUGMENT_FAST_AUGMENT_SHARED_
#define GPUFEED_SERVER_AUGMENT_FAST_AUGMENT_SHARED_

#include "server/augment/fast_augment.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "server/augment/augment_pixel.h"
#include "server/augment/fast_augment_plan.h"

#endif  // GPUFEED_SERVER_AUGMENT_FAST_AUGMENT_SHARED_

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "server/augment/fast_augment.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace gpufeed::server {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using DU16 = hn::Rebind<uint16_t, DF>;
using IndicesF = decltype(hn::IndicesFromVec(DF(), hn::Zero(DI())));
inline constexpr size_t kMaxLanes = HWY_MAX_BYTES / sizeof(float);
using fast_augment::BuildPlan;
using fast_augment::kMaxTables;
using fast_augment::Plan;
using fast_augment::Scratch;
using fast_augment::ThreadScratch;

// float16 bits, as FloatToHalf. Where the target has F16C, its conversion (round to nearest
// even, as FloatToHalf) after NaNs become sign | 0x7FC00000, which it converts to FloatToHalf's
// NaN, sign | 0x7E00; elsewhere FloatToHalf per lane.
HWY_INLINE hn::Vec<DU16> HalfBits(VF v) {
  const DF df;
  const DU16 du16;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  const DU du;
  const auto sign = hn::And(hn::BitCast(du, v), hn::Set(du, 0x80000000u));
  const VF quiet = hn::BitCast(df, hn::Or(sign, hn::Set(du, 0x7FC00000u)));
  const VF safe = hn::IfThenElse(hn::IsNaN(v), quiet, v);
  return hn::BitCast(du16, hn::DemoteTo(hn::Rebind<hwy::float16_t, DF>(), safe));
#else
  HWY_ALIGN float in[kMaxLanes];
  HWY_ALIGN uint16_t out[kMaxLanes];
  hn::Store(v, df, in);
  for (size_t i = 0; i < hn::Lanes(df); ++i) out[i] = FloatToHalf(in[i]);
  return hn::Load(du16, out);
#endif
}

// bfloat16 bits, as FloatToBFloat16: round to nearest even in integer lanes, NaN kept a quiet
// NaN.
HWY_INLINE hn::Vec<DU16> BFloat16Bits(VF v) {
  const DU du;
  const DI di;
  const auto bits = hn::BitCast(du, v);
  const auto high = hn::ShiftRight<16>(bits);
  const auto rounding = hn::Add(hn::Set(du, 0x7FFFu), hn::And(high, hn::Set(du, 1u)));
  const auto rounded = hn::ShiftRight<16>(hn::Add(bits, rounding));
  const auto nan = hn::Or(high, hn::Set(du, 0x0040u));
  const auto result = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), nan, rounded);
  return hn::DemoteTo(DU16(), hn::BitCast(di, result));  // values <= 0xFFFF: exact
}

// The output stages: per channel, a float vector to a vector of the output's lanes.
struct UInt8Stage {
  using T = uint8_t;
  HWY_INLINE hn::Vec<hn::Rebind<T, DF>> operator()(VF v, int /*channel*/) const {
    const DF df;
    // Round half up and clamp, as WriteImage.
    const VF r = hn::Min(hn::Max(hn::Floor(hn::Add(v, hn::Set(df, 0.5f))), hn::Zero(df)),
                         hn::Set(df, 255.0f));
    return hn::DemoteTo(hn::Rebind<T, DF>(), hn::ConvertTo(DI(), r));
  }
};

struct Float32Stage {
  using T = float;
  ChannelAffine a;
  HWY_INLINE VF operator()(VF v, int c) const {
    const DF df;
    return hn::Add(hn::Mul(v, hn::Set(df, a.scale[c])), hn::Set(df, a.bias[c]));
  }
};

struct HalfStage {
  using T = uint16_t;
  Float32Stage affine;
  HWY_INLINE hn::Vec<DU16> operator()(VF v, int c) const { return HalfBits(affine(v, c)); }
};

struct BFloat16Stage {
  using T = uint16_t;
  Float32Stage affine;
  HWY_INLINE hn::Vec<DU16> operator()(VF v, int c) const { return BFloat16Bits(affine(v, c)); }
};

// Lane i of the result: element idx[i] of the kTables vectors t0.. taken as one table (kTables
// from 1 to 4; the unused ones are ignored). `local` is idx modulo the lanes, `from1`..`from3`
// the lanes whose element lies in t1.. or later.
template <int kTables>
HWY_INLINE VF Pick(VF t0, VF t1, VF t2, VF t3, hn::Vec<DI> idx, IndicesF local, hn::Mask<DF> from1,
                   hn::Mask<DF> from2, hn::Mask<DF> from3) {
  if constexpr (kTables == 1) return hn::TableLookupLanes(t0, local);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // Two tables in one instruction (which reads idx modulo 32); four: two and a blend.
  (void)from1;
  (void)from3;
  const VF low = VF{_mm512_permutex2var_ps(t0.raw, idx.raw, t1.raw)};
  if constexpr (kTables == 2) return low;
  return hn::IfThenElse(from2, VF{_mm512_permutex2var_ps(t2.raw, idx.raw, t3.raw)}, low);
#else
  (void)idx;
  VF v = hn::IfThenElse(from1, hn::TableLookupLanes(t1, local), hn::TableLookupLanes(t0, local));
  if constexpr (kTables >= 3) v = hn::IfThenElse(from2, hn::TableLookupLanes(t2, local), v);
  if constexpr (kTables >= 4) v = hn::IfThenElse(from3, hn::TableLookupLanes(t3, local), v);
  return v;
#endif
}

// One block's taps for the three channels, from their lines at r, g, b: per tap, each lane's
// input picked out of kTables vectors of the line (0: gathered), times the lane's weight,
// added to the accumulators.
template <int kTables>
HWY_INLINE void BlockTaps(const float* r, const float* g, const float* b, const int32_t* index,
                          const float* weight, size_t taps, size_t lanes, VF& acc_r, VF& acc_g,
                          VF& acc_b) {
  const DF df;
  const DI di;
  // The tables past kTables repeat the first (unused; loaded to keep every pick's form).
  const size_t t1 = kTables > 1 ? lanes : 0, t2 = kTables > 2 ? 2 * lanes : 0;
  const size_t t3 = kTables > 3 ? 3 * lanes : 0;
  const VF r0 = hn::LoadU(df, r), r1 = hn::LoadU(df, r + t1), r2 = hn::LoadU(df, r + t2),
           r3 = hn::LoadU(df, r + t3);
  const VF g0 = hn::LoadU(df, g), g1 = hn::LoadU(df, g + t1), g2 = hn::LoadU(df, g + t2),
           g3 = hn::LoadU(df, g + t3);
  const VF b0 = hn::LoadU(df, b), b1 = hn::LoadU(df, b + t1), b2 = hn::LoadU(df, b + t2),
           b3 = hn::LoadU(df, b + t3);
  const auto lanes_i = static_cast<int32_t>(lanes);
  for (size_t k = 0; k < taps; ++k) {
    const auto idx = hn::LoadU(di, index + k * lanes);
    const VF w = hn::LoadU(df, weight + k * lanes);
    VF vr, vg, vb;
    if constexpr (kTables == 0) {
      vr = hn::GatherIndex(df, r, idx);
      vg = hn::GatherIndex(df, g, idx);
      vb = hn::GatherIndex(df, b, idx);
    } else {
      const auto local = hn::IndicesFromVec(df, hn::And(idx, hn::Set(di, lanes_i - 1)));
      const auto from1 = hn::RebindMask(df, hn::Gt(idx, hn::Set(di, lanes_i - 1)));
      const auto from2 = hn::RebindMask(df, hn::Gt(idx, hn::Set(di, 2 * lanes_i - 1)));
      const auto from3 = hn::RebindMask(df, hn::Gt(idx, hn::Set(di, 3 * lanes_i - 1)));
      vr = Pick<kTables>(r0, r1, r2, r3, idx, local, from1, from2, from3);
      vg = Pick<kTables>(g0, g1, g2, g3, idx, local, from1, from2, from3);
      vb = Pick<kTables>(b0, b1, b2, b3, idx, local, from1, from2, from3);
    }
    acc_r = hn::Add(acc_r, hn::Mul(w, vr));
    acc_g = hn::Add(acc_g, hn::Mul(w, vg));
    acc_b = hn::Add(acc_b, hn::Mul(w, vb));
  }
}

// BlockTaps<tables>, for tables from 0 to kMaxTables.
template <int kTables = kMaxTables>
HWY_INLINE void BlockTapsFor(int tables, const float* r, const float* g, const float* b,
                             const int32_t* index, const float* weight, size_t taps, size_t lanes,
                             VF& acc_r, VF& acc_g, VF& acc_b) {
  if constexpr (kTables == 0) {
    BlockTaps<0>(r, g, b, index, weight, taps, lanes, acc_r, acc_g, acc_b);
  } else if (tables == kTables) {
    BlockTaps<kTables>(r, g, b, index, weight, taps, lanes, acc_r, acc_g, acc_b);
  } else {
    BlockTapsFor<kTables - 1>(tables, r, g, b, index, weight, taps, lanes, acc_r, acc_g, acc_b);
  }
}

// The horizontal pass over crop row `src` into three planar lines at `dst` (channel c at
// dst + c * p.line): the row's channels to planar floats, then the blocks' taps.
HWY_INLINE void Horizontal(const Plan& p, const uint8_t* src, Scratch& s, float* dst) {
  const DF df;
  const DI di;
  const hn::ScalableTag<uint8_t> d8;
  const hn::Rebind<uint8_t, DF> d8f;
  const size_t lanes = static_cast<size_t>(p.lanes);
  const size_t stride = static_cast<size_t>(p.plane_floats);
  uint8_t* bytes = s.bytes.data();
  float* planes = s.planes.data();
  // Deinterleave: whole vectors, the last ending at col_hi; a narrower span byte by byte.
  const size_t lo = static_cast<size_t>(p.col_lo), hi = static_cast<size_t>(p.col_hi);
  const size_t step = hn::Lanes(d8);
  if (hi - lo >= step) {
    for (size_t x = lo;; x += step) {
      x = std::min(x, hi - step);
      hn::Vec<decltype(d8)> r, g, b;
      hn::LoadInterleaved3(d8, src + 3 * x, r, g, b);
      hn::StoreU(r, d8, bytes + x);
      hn::StoreU(g, d8, bytes + stride + x);
      hn::StoreU(b, d8, bytes + 2 * stride + x);
      if (x + step >= hi) break;
    }
  } else {
    for (size_t x = lo; x < hi; ++x) {
      for (int c = 0; c < 3; ++c) bytes[c * stride + x] = src[3 * x + c];
    }
  }
  for (int c = 0; c < 3; ++c) {
    for (size_t x = lo; x < hi; x += lanes) {  // past hi: bytes of earlier rows, unread
      const auto v = hn::PromoteTo(di, hn::LoadU(d8f, bytes + c * stride + x));
      hn::StoreU(hn::ConvertTo(df, v), df, planes + c * stride + x);
    }
  }
  const size_t taps = static_cast<size_t>(p.col_taps);
  for (size_t b = 0; b < p.block_x.size(); ++b) {
    const size_t base = static_cast<size_t>(p.block_base[b]);
    const float* r = planes + base;
    const float* g = r + stride;
    const float* bl = g + stride;
    const int32_t* index = &p.col_index[b * taps * lanes];
    const float* weight = &p.col_weight[b * taps * lanes];
    VF acc_r = hn::Zero(df), acc_g = hn::Zero(df), acc_b = hn::Zero(df);
    BlockTapsFor(p.block_tables[b], r, g, bl, index, weight, taps, lanes, acc_r, acc_g, acc_b);
    float* d = dst + p.block_x[b];
    hn::StoreU(acc_r, df, d);
    hn::StoreU(acc_g, df, d + p.line);
    hn::StoreU(acc_b, df, d + 2 * p.line);
  }
}

template <class Stage>
void Passes(const Image& image, const StagedGeometry& g, int out_height, int out_width,
            Layout layout, const Stage& stage, Scratch& s, std::byte* out) {
  using T = typename Stage::T;
  const DF df;
  const hn::Rebind<T, DF> dt;
  const Plan& p = s.plan;
  const size_t lanes = static_cast<size_t>(p.lanes);
  const size_t line = static_cast<size_t>(p.line);
  const size_t ring_lines = static_cast<size_t>(p.row_taps);
  if (s.ring.size() < ring_lines * 3 * line) s.ring.resize(ring_lines * 3 * line);
  s.ring_row.assign(ring_lines, -1);
  const size_t pitch = static_cast<size_t>(image.width) * 3;
  const uint8_t* crop = image.rgb.data() + static_cast<size_t>(g.crop_top) * pitch +
                        static_cast<size_t>(g.crop_left) * 3;
  const size_t planes = 3 * static_cast<size_t>(p.plane_floats);
  if (s.planes.size() < planes) {
    s.planes.resize(planes);
    s.bytes.resize(planes);
  }
  T* const out_t = reinterpret_cast<T*>(out);
  const size_t plane = static_cast<size_t>(out_height) * out_width;
  const size_t width = static_cast<size_t>(out_width);
  // Narrower than a vector: through a buffer, then the columns that exist.
  const bool narrow = width < lanes;
  HWY_ALIGN T buffer[3 * kMaxLanes];
  s.lines.resize(ring_lines);
  for (int y = 0; y < out_height; ++y) {
    const size_t n = static_cast<size_t>(p.row_count[y]);
    const int lo = p.row_first[y];
    for (size_t k = 0; k < n; ++k) {  // the crop rows this row reads, each computed once
      const int j = lo + static_cast<int>(k);
      const size_t slot = static_cast<size_t>(j) % ring_lines;
      float* at = s.ring.data() + slot * 3 * line;
      if (s.ring_row[slot] != j) {
        Horizontal(p, crop + static_cast<size_t>(j) * pitch, s, at);
        s.ring_row[slot] = j;
      }
      s.lines[k] = at;
    }
    const float* weight = &p.row_weight[static_cast<size_t>(y) * p.row_stride];
    for (const int32_t x0 : p.block_x) {
      VF v0 = hn::Zero(df), v1 = hn::Zero(df), v2 = hn::Zero(df);
      for (size_t k = 0; k < n; ++k) {
        const VF w = hn::Set(df, weight[k]);
        const float* l = s.lines[k] + x0;
        v0 = hn::Add(v0, hn::Mul(w, hn::LoadU(df, l)));
        v1 = hn::Add(v1, hn::Mul(w, hn::LoadU(df, l + line)));
        v2 = hn::Add(v2, hn::Mul(w, hn::LoadU(df, l + 2 * line)));
      }
      const size_t at = static_cast<size_t>(y) * width + static_cast<size_t>(x0);
      if (layout == Layout::kNHWC) {
        T* d = out_t + 3 * at;
        hn::StoreInterleaved3(stage(v0, 0), stage(v1, 1), stage(v2, 2), dt, narrow ? buffer : d);
        if (narrow) std::memcpy(d, buffer, 3 * width * sizeof(T));
      } else {
        T* d = out_t + at;
        hn::StoreU(stage(v0, 0), dt, narrow ? buffer : d);
        hn::StoreU(stage(v1, 1), dt, narrow ? buffer + lanes : d + plane);
        hn::StoreU(stage(v2, 2), dt, narrow ? buffer + 2 * lanes : d + 2 * plane);
        if (narrow) {
          for (int c = 0; c < 3; ++c) {
            std::memcpy(d + c * plane, buffer + c * lanes, width * sizeof(T));
          }
        }
      }
    }
  }
}

void AugmentTarget(const Image& image, const StagedGeometry& g, int out_height, int out_width,
                   const OutputSpec& spec, std::byte* out) {
  Scratch& s = ThreadScratch();
  BuildPlan(g, out_height, out_width, static_cast<int>(hn::Lanes(DF())), &s.plan);
  const Float32Stage affine{OutputAffine(spec)};
  switch (spec.dtype) {
    case DType::kUInt8:
      Passes(image, g, out_height, out_width, spec.layout, UInt8Stage{}, s, out);
      break;
    case DType::kFloat32:
      Passes(image, g, out_height, out_width, spec.layout, affine, s, out);
      break;
    case DType::kFloat16:
      Passes(image, g, out_height, out_width, spec.layout, HalfStage{affine}, s, out);
      break;
    default:
      Passes(image, g, out_height, out_width, spec.layout, BFloat16Stage{affine}, s, out);
      break;
  }
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  // Leave the upper halves of the vector registers clean, whatever g++ made of the code above:
  // legacy-SSE code after dirty ones runs several times slower (the scalar WriteImage's uint8
  // loop 5x on Zen 4, when a call passing vectors was not inlined and g++ left out its
  // vzeroupper).
  _mm256_zeroupper();
#endif
}

struct HalfOf {
  HWY_INLINE hn::Vec<DU16> operator()(VF v) const { return HalfBits(v); }
};
struct BFloat16Of {
  HWY_INLINE hn::Vec<DU16> operator()(VF v) const { return BFloat16Bits(v); }
};

// `bits` per vector of `in`; the tail through a buffer.
template <class Bits>
void ConvertFloats(const float* in, size_t count, uint16_t* out, Bits bits) {
  const DF df;
  const DU16 du16;
  const size_t lanes = hn::Lanes(df);
  size_t i = 0;
  for (; i + lanes <= count; i += lanes) hn::StoreU(bits(hn::LoadU(df, in + i)), du16, out + i);
  if (i == count) return;
  HWY_ALIGN float tail_in[kMaxLanes] = {};
  HWY_ALIGN uint16_t tail_out[kMaxLanes];
  std::memcpy(tail_in, in + i, (count - i) * sizeof(float));
  hn::Store(bits(hn::Load(df, tail_in)), du16, tail_out);
  std::memcpy(out + i, tail_out, (count - i) * sizeof(uint16_t));
}

void HalfTarget(const float* in, size_t count, uint16_t* out) {
  ConvertFloats(in, count, out, HalfOf());
}

void BFloat16Target(const float* in, size_t count, uint16_t* out) {
  ConvertFloats(in, count, out, BFloat16Of());
}

}  // namespace HWY_NAMESPACE
}  // namespace gpufeed::server
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace gpufeed::server {

HWY_EXPORT(AugmentTarget);
HWY_EXPORT(HalfTarget);
HWY_EXPORT(BFloat16Target);

void FastAugment(const Image& image, const StagedGeometry& geometry, int out_height, int out_width,
                 const OutputSpec& spec, std::byte* out) {
  HWY_DYNAMIC_DISPATCH(AugmentTarget)(image, geometry, out_height, out_width, spec, out);
}

void FloatsToHalf(const float* in, size_t count, uint16_t* out) {
  HWY_DYNAMIC_DISPATCH(HalfTarget)(in, count, out);
}

void FloatsToBFloat16(const float* in, size_t count, uint16_t* out) {
  HWY_DYNAMIC_DISPATCH(BFloat16Target)(in, count, out);
}

}  // namespace gpufeed::server
#endif  // HWY_ONCE
