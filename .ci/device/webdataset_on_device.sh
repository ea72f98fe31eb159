#!/usr/bin/env bash
# The WebDataset image benchmark on the GPU machine: the same JPEGs as an ImageFolder and as
# WebDataset tar shards, read the way users drive them (gpufeedctl consume), through nvJPEG +
# the GPU kernel with device delivery, and through the CPU path with host delivery. Here:
# tests/run.sh && .ci/device/bundle.sh; device: run with carry [".devbundle"]:
#   bash .ci/device/webdataset_on_device.sh        IMAGES=5000 SHARDS=16 BATCHES=300
# Prints a table (batches/s, images/s, the shards' rate against the folder's) and a JSON line;
# summary.log under $OUT.
set -u
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-wds
rm -rf "$out"; mkdir -p "$out" "$final"
source "$(dirname "$0")/device_env.sh"
images=${IMAGES:-5000} shards=${SHARDS:-16} batches=${BATCHES:-300}
folder=/tmp/gpufeed-wds-folder tars=$out/shards
python3 "$root/tests/bench/image/make_dataset.py" --out "$folder" --images "$images" --classes 100 \
    --seed 5 >"$out/make_dataset.log" 2>&1
# The shards: samples in a shuffled order (as WebDataset writers do), key.jpg + key.cls each.
python3 - "$folder" "$tars" "$shards" <<'PY'
import io, os, random, sys, tarfile
folder, tars, shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(tars)
classes = sorted(os.listdir(folder))
samples = [(c, i, os.path.join(folder, name, f)) for i, name in enumerate(classes)
           for c, f in enumerate(sorted(os.listdir(os.path.join(folder, name))))]
random.Random(0).shuffle(samples)
per = -(-len(samples) // shards)
for s in range(shards):
    with tarfile.open(os.path.join(tars, f"train-{s:06d}.tar"), "w", format=tarfile.GNU_FORMAT) as t:
        for k, (_, label, path) in enumerate(samples[s * per:(s + 1) * per]):
            key = f"{s:06d}_{k:06d}"
            t.add(path, arcname=f"{key}.jpg")
            data = str(label).encode()
            info = tarfile.TarInfo(f"{key}.cls"); info.size = len(data)
            t.addfile(info, io.BytesIO(data))
PY
cat "$tars"/*.tar >/dev/null; find "$folder" -name '*.jpg' -print0 | xargs -0 cat >/dev/null
log "dataset: $images JPEGs ($(du -sh "$folder" | cut -f1)), $shards shards ($(du -sh "$tars" | cut -f1))"
sock=/tmp/gf-wds.sock
start_daemon "$sock" "$out/gpufeedd.log" --threads=12 --staging_bytes=$((4 << 30)) \
    --device_bytes=$((8 << 30)) || exit 1
consume() {  # consume TAG KIND DATASET [flags]: batches/s of one session into $out/TAG.json
  local tag=$1 kind=$2 dataset=$3; shift 3
  local t0=$(date +%s.%N)
  "$ctl" --socket "$sock" consume --job "$tag" --kind "$kind" --dataset "$dataset" \
      --pipeline "$root/deploy/pipelines/imagenet_train.json" --batch-size 256 --epochs 0 \
      --max-batches "$batches" -o json "$@" >"$out/$tag.json" 2>"$out/$tag.err"
  log "$tag: $(tr -d '\n' <"$out/$tag.json" | cut -c1-300) $(tail -2 "$out/$tag.err" | tr '\n' ' ')"
}
for path in nvjpeg cpu; do
  if [ $path = nvjpeg ]; then flags="--device cuda:0 --decode nvjpeg --augment gpu"; else flags="--decode cpu --augment cpu"; fi
  consume "folder-$path-warm" image_folder "$folder" $flags --max-batches 40
  consume "folder-$path" image_folder "$folder" $flags
  consume "wds-$path-warm" webdataset "$tars/train-{000000..$(printf %06d $((shards - 1)))}.tar" $flags --max-batches 40
  consume "wds-$path" webdataset "$tars/train-{000000..$(printf %06d $((shards - 1)))}.tar" $flags
done
stop_daemon
python3 - "$out" <<'PY' | tee -a "$out/summary.log"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def rate(tag):
    try:
        return json.loads((out / f"{tag}.json").read_text())["batches_per_s"]
    except Exception:
        return None
print("\n| path | ImageFolder images/s | WebDataset images/s | WebDataset vs folder |")
print("|---|---:|---:|---:|")
summary = {"bench": "webdataset_vs_folder"}
for path, name in (("nvjpeg", "nvJPEG + GPU kernel, device delivery"), ("cpu", "CPU decode + augment, host delivery")):
    f, w = rate(f"folder-{path}"), rate(f"wds-{path}")
    if f is None or w is None:
        print(f"| {name} | {f} | {w} | failed |"); continue
    print(f"| {name} | {256 * f:,.0f} | {256 * w:,.0f} | {100 * w / f:.1f} % |")
    summary[path] = {"folder_images_per_s": round(256 * f), "webdataset_images_per_s": round(256 * w),
                     "ratio": round(w / f, 4)}
print(json.dumps(summary))
PY
cp "$out/summary.log" "$final/"
tar -czf "$final/logs.tgz" -C "$out" --exclude=shards . 2>/dev/null
