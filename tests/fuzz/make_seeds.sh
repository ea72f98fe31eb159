#!/usr/bin/env bash
# Regenerates the hand-made seed corpora in corpus/<target>/: valid and near-valid inputs,
# each small. Needs protoc, python3, g++ and libturbojpeg/libpng headers (deploy/install-deps.sh).
# The seeds are committed; run this only to change them, and commit what it writes.
set -euo pipefail
cd "$(dirname "$0")"
root=../..
c=corpus
rm -rf "$c"
mkdir -p $c/attach_request $c/npy_header $c/pipeline_json $c/mem_frame $c/image_header $c/tar_index

# --- attach_request: serialized v1::AttachRequest, written from text format.
enc() {
  protoc --proto_path=$root/proto --encode=gpufeed.v1.AttachRequest gpufeed/v1/feed.proto \
    > "$c/attach_request/$1"
}
enc tokens_valid <<'P'
job: "train" rank: 1 world_size: 2 batch_size: 8 seed: 42 shuffle: true drop_last: true ring_slots: 4
dataset { kind: DATASET_KIND_TOKENS path: "/data/tokens.bin" token_dtype: DTYPE_UINT16 seq_len: 1024 vocab_size: 50257 }
start { epoch: 3 step: 7 fingerprint: "abc" } stop_epoch: 10
P
enc records_valid <<'P'
job: "eval" world_size: 1 batch_size: 32 dataset { kind: DATASET_KIND_RECORDS path: "/data/x.npy" }
delivery { kind: DELIVERY_KIND_HOST }
P
enc image_train <<'P'
job: "imagenet" world_size: 8 rank: 7 batch_size: 256 shuffle: true
dataset { kind: DATASET_KIND_IMAGE_FOLDER path: "/data/imagenet/train" }
pipeline { decode { dct_scaling: true } }
pipeline { random_resized_crop { size: 224 scale_min: 0.08 scale_max: 1 ratio_min: 0.75 ratio_max: 1.3333333 } }
pipeline { flip { p: 0.5 } }
pipeline { normalize { mean: [0.485, 0.456, 0.406] std: [0.229, 0.224, 0.225] } }
pipeline { cast { dtype: DTYPE_FLOAT16 } }
pipeline { layout { layout: IMAGE_LAYOUT_NHWC } }
bad_sample: BAD_SAMPLE_POLICY_FAIL decode: IMAGE_DECODE_CPU augment: IMAGE_AUGMENT_GPU
P
enc image_eval <<'P'
job: "imagenet-eval" world_size: 1 batch_size: 64
dataset { kind: DATASET_KIND_IMAGE_FOLDER path: "/data/imagenet/val" }
pipeline { resize { shorter_side: 256 } } pipeline { center_crop { size: 224 } }
pipeline { cast { dtype: DTYPE_UINT8 } }
P
enc device_vmm <<'P'
job: "dev" world_size: 1 batch_size: 4 dataset { kind: DATASET_KIND_TOKENS path: "/d" seq_len: 8 }
delivery { kind: DELIVERY_KIND_DEVICE gpu_uuid: "GPU-00000000-0000-0000-0000-000000000000" ipc: IPC_KIND_VMM }
P
enc bad_rank <<'P'
job: "j" rank: 5 world_size: 2 batch_size: 1 dataset { kind: DATASET_KIND_TOKENS path: "/d" seq_len: 1 }
P
enc bad_epoch <<'P'
job: "j" world_size: 1 batch_size: 1 dataset { kind: DATASET_KIND_TOKENS path: "relative" seq_len: 1 }
start { epoch: 9223372036854775807 step: -1 } stop_epoch: -5
P
enc bad_pipeline <<'P'
job: "j" world_size: 1 batch_size: 1 dataset { kind: DATASET_KIND_IMAGE_FOLDER path: "/i" }
pipeline { center_crop { size: 300 } } pipeline { resize { shorter_side: 256 } }
pipeline { flip { p: 2 } } pipeline { }
P

# --- pipeline_json: the shipped pipelines, and near misses.
cp $root/deploy/pipelines/imagenet_train.json $c/pipeline_json/imagenet_train.json
cp $root/deploy/pipelines/imagenet_eval.json $c/pipeline_json/imagenet_eval.json
printf '%s' '{"ops": [{"decode": {"dct_scaling": true}}, {"resize": {"shorter_side": 64}}, {"center_crop": {"size": 32}}, {"flip": {}}, {"cast": {"dtype": "DTYPE_BFLOAT16"}}]}' > $c/pipeline_json/resize_crop.json
printf '%s' '{"ops": [{"random_resized_crop": {"size": 8, "ratio_min": 1e-30, "ratio_max": 1e30}}]}' > $c/pipeline_json/extreme_ratio.json
printf '%s' '{"ops": [{"center_crop": {"size": "16"}}, {"normalize": {"mean": [1, 2], "std": [0, -1, "NaN"]}}]}' > $c/pipeline_json/near_miss.json
printf '%s' '{"ops": 3}' > $c/pipeline_json/not_a_list.json

# --- npy_header: version 1, 2 and 3 headers as numpy writes them, and near misses.
python3 - "$c/npy_header" <<'P'
import sys, struct
out = sys.argv[1]
def header(d, major=1):
    fixed = 10 if major == 1 else 12
    n = ((fixed + len(d) + 1 + 63) // 64) * 64 - fixed
    ln = struct.pack('<H', n) if major == 1 else struct.pack('<I', n)
    return b'\x93NUMPY' + bytes([major, 0]) + ln + d.encode('latin1') + b' ' * (n - len(d) - 1) + b'\n'
def put(name, data):
    open(f'{out}/{name}', 'wb').write(data)
put('u2_vector', header("{'descr': '<u2', 'fortran_order': False, 'shape': (100,), }") + b'\0' * 8)
put('f4_matrix_v2', header("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", 2))
put('u1_v3', header("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 2, 2), }", 3))
put('structured', header("{'descr': [('a', '<i4'), ('b', '<f8')], 'fortran_order': False, 'shape': (5,), }"))
put('fortran', header("{'descr': '<i8', 'fortran_order': True, 'shape': (2, 3), }"))
put('big_endian', header("{'descr': '>u4', 'fortran_order': False, 'shape': (7,), }"))
put('zero_d', header("{'descr': '<c16', 'fortran_order': False, 'shape': (), }"))
put('object', header("{\"descr\": \"|O\", \"fortran_order\": False, \"shape\": (1,)}"))
put('huge_dim', header("{'descr': '<u2', 'fortran_order': False, 'shape': (99999999999999999999, 1), }"))
put('truncated', header("{'descr': '<u2', 'fortran_order': False, 'shape': (100,), }")[:40])
put('long_len', b'\x93NUMPY\x02\x00\xff\xff\xff\xff{}')
P

# --- mem_frame: [fd bits][write size][little-endian length][MemRequest].
memreq() {
  protoc --proto_path=$root/proto --encode=gpufeed.v1.MemRequest gpufeed/v1/feed.proto
}
frame() {  # frame NAME FD_BITS WRITE_SIZE < message
  python3 -c '
import sys, struct
body = sys.stdin.buffer.read()
sys.stdout.buffer.write(bytes([int(sys.argv[1]), int(sys.argv[2])]) + struct.pack("<I", len(body)) + body)
' "$2" "$3" > "$c/mem_frame/$1"
}
echo 'session_id: 7 token: "0123456789abcdef0123456789abcdef"' | memreq | frame request 0 63
echo 'session_id: 18446744073709551615 token: "x"' | memreq | frame request_split_fds 5 2
echo 'session_id: 1' | memreq | frame request_three_fds 65 0
echo 'session_id: 2' | memreq | frame request_eight_fds 193 0  # more than RecvFrame takes
printf '\0\0\x00\x04\0\0' > $c/mem_frame/length_only  # declares 1024 bytes, sends none
printf '\0\0\x01\x04\0\0' > $c/mem_frame/too_long   # declares 1025 bytes
printf '\x01\x00\x05\x00' > $c/mem_frame/short      # 2 bytes of a 4-byte length

# --- image_header: tiny JPEGs and PNGs from TurboJPEG and libpng, and near misses.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/make.cc" <<'P'
#include <png.h>
#include <turbojpeg.h>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
static void Put(const std::string& path, const unsigned char* p, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb"); std::fwrite(p, 1, n, f); std::fclose(f);
}
static void Jpeg(const std::string& path, int w, int h, int samp, int flags,
                 int format = TJPF_RGB) {
  std::vector<unsigned char> px(w * h * tjPixelSize[format]);
  for (size_t i = 0; i < px.size(); ++i) px[i] = (i * 37) & 255;
  tjhandle t = tjInitCompress(); unsigned char* out = nullptr; unsigned long n = 0;
  tjCompress2(t, px.data(), w, 0, h, format, &out, &n, samp, 75, flags);
  Put(path, out, n); tjFree(out); tjDestroy(t);
}
static void Png(const std::string& path, int w, int h, png_uint_32 format) {
  png_image img; std::memset(&img, 0, sizeof img);
  img.version = PNG_IMAGE_VERSION; img.width = w; img.height = h; img.format = format;
  std::vector<unsigned char> px(PNG_IMAGE_SIZE(img));
  for (size_t i = 0; i < px.size(); ++i) px[i] = (i * 11) & 255;
  png_alloc_size_t n = 0;
  png_image_write_to_memory(&img, nullptr, &n, 0, px.data(), 0, nullptr);
  std::vector<unsigned char> out(n);
  png_image_write_to_memory(&img, out.data(), &n, 0, px.data(), 0, nullptr);
  Put(path, out.data(), n);
}
int main(int, char** argv) {
  const std::string d = argv[1];
  Jpeg(d + "/baseline_420.jpg", 9, 7, TJSAMP_420, 0);
  Jpeg(d + "/progressive_444.jpg", 5, 3, TJSAMP_444, TJFLAG_PROGRESSIVE);
  Jpeg(d + "/gray.jpg", 4, 4, TJSAMP_GRAY, 0);
  Jpeg(d + "/cmyk.jpg", 3, 3, TJSAMP_444, 0, TJPF_CMYK);
  Jpeg(d + "/422.jpg", 17, 2, TJSAMP_422, 0);
  Jpeg(d + "/440.jpg", 2, 17, TJSAMP_440, 0);
  Png(d + "/rgba.png", 5, 3, PNG_FORMAT_RGBA);
  Png(d + "/gray.png", 3, 2, PNG_FORMAT_GRAY);
  Png(d + "/rgb16.png", 2, 2, PNG_FORMAT_RGB | PNG_FORMAT_FLAG_LINEAR);
}
P
g++ -std=c++20 -O1 "$tmp/make.cc" -o "$tmp/make" -lturbojpeg -lpng
"$tmp/make" $c/image_header
head -c 60 $c/image_header/baseline_420.jpg > $c/image_header/truncated.jpg
head -c 40 $c/image_header/rgba.png > $c/image_header/truncated.png
# A JPEG whose SOF0 says 65535 x 65535: over any pixel cap, from the header alone.
python3 - $c/image_header <<'P'
import sys
d = sys.argv[1]
j = bytearray(open(f'{d}/baseline_420.jpg', 'rb').read())
i = j.find(b'\xff\xc0')
j[i + 5:i + 9] = b'\xff\xff\xff\xff'
open(f'{d}/huge_sof.jpg', 'wb').write(j)
open(f'{d}/gif', 'wb').write(b'GIF89a\x01\x00\x01\x00')
P
# --- tar_index: WebDataset shards as Python's tarfile writes them (GNU with a long name, pax
# with a long path, ustar), with a directory and a link to skip, and one cut short.
python3 - $c/tar_index <<'P'
import io, sys, tarfile
d = sys.argv[1]
def tar(fmt, members, others=True):
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w", format=fmt) as t:
        for name, data in members:
            i = tarfile.TarInfo(name); i.size = len(data); t.addfile(i, io.BytesIO(data))
        if others:  # a directory and a link, which the index skips
            di = tarfile.TarInfo("dir"); di.type = tarfile.DIRTYPE; t.addfile(di)
            li = tarfile.TarInfo("link"); li.type = tarfile.SYMTYPE; li.linkname = "x"; t.addfile(li)
    v = b.getvalue().rstrip(b"\0")
    return v + b"\0" * (-len(v) % 512 + 1024)  # no record padding: seeds stay small
m = [("k1.cls", b"3\n"), ("k1.jpg", b"\xff\xd8" + b"j" * 300)]
long = [("d" * 150 + "/k2.cls", b"1")]
open(f"{d}/gnu", "wb").write(tar(tarfile.GNU_FORMAT, long, others=False))
open(f"{d}/pax", "wb").write(tar(tarfile.PAX_FORMAT, long, others=False))
open(f"{d}/ustar", "wb").write(tar(tarfile.USTAR_FORMAT, m))
open(f"{d}/truncated", "wb").write(tar(tarfile.GNU_FORMAT, m)[:1536 + 100])
P
ls -l $c/*/ | awk '$5 > 4096 {print "large seed: " $0; bad=1} END {exit bad}'
echo "seeds: $(find $c -type f | wc -l) files, $(du -sb $c | cut -f1) bytes"
