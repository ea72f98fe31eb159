#!/usr/bin/env bash
# Would nvJPEG in the training's own CUDA context (a consumer-side decode) cost the
# training less than in another process's, as gpufeedd's does today? Synthetic ResNet-50
# (.ci/device/inprocess_nvjpeg_probe.py, one GPU, no MPS) alone; with nvJPEG's hardware
# decode of 256 images every STEP_MS in a thread of the same process; beside image_bench
# nvjpeg doing the same in its own process (the daemon's case); alone again.
# INPROCESS="59:0 59:-1 0:0": in-process rows as MS:PRIORITY (one batch every MS, 0: back to
# back; the decode stream's priority, -1: above the training's); OTHER="59": other-process
# rows. 59 ms is a batch per training step: every row to nvJPEG.
# Here: tests/run.sh && .ci/device/bundle.sh; device: run with carry [".devbundle"]:
# bash .ci/device/inprocess_nvjpeg_on_device.sh. Prints a table and one JSON line.
set -u
final=${OUT:-/tmp/gpufeed-out}
out=/tmp/gpufeed-inprocess
rm -rf "$out"; mkdir -p "$out" "$final"
source "$(dirname "$0")/device_env.sh"
bench=$bundle/bin/image_bench
probe=$root/.ci/device/inprocess_nvjpeg_probe.py
steps=${STEPS:-200}
data=/tmp/gpufeed-images
image_dataset "$data" "${IMAGES:-3000}"

run() {  # run TAG [probe flags]: one probe; its JSON line to $out/TAG.json
  local tag=$1; shift
  timeout 150 python3 "$probe" --data "$data" --steps "$steps" "$@" >"$out/$tag.log" 2>&1
  grep '^{' "$out/$tag.log" | tail -1 >"$out/$tag.json"
  log "$tag: $(cat "$out/$tag.json") $(grep -E 'Error|error' "$out/$tag.log" | tail -2)"
}
beside() {  # beside TAG MS: the probe alone while image_bench nvjpeg decodes in its own process
  local tag=$1 ms=$2
  "$bench" nvjpeg --data "$data" --batch 256 --seconds 60 --format rgbi --step-ms "$ms" \
      >"$out/$tag.bench.json" 2>"$out/$tag.bench.err" &
  local pid=$!
  sleep 4  # the files into pinned memory, the decoder warmed up
  run "$tag"
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  log "$tag: image_bench's last progress: $(tr '\r' '\n' <"$out/$tag.bench.err" | grep . | tail -1)"
}
log "synthetic ResNet-50, $steps steps, no MPS"
run alone
for v in ${INPROCESS:-59:0 59:-1 0:0}; do  # MS:PRIORITY (MS 0: back to back)
  run "inprocess_${v%%:*}_p${v#*:}" --decode --step-ms "${v%%:*}" --priority "${v#*:}"
done
for ms in ${OTHER:-59}; do beside "otherprocess_$ms" "$ms"; done
run alone_again
python3 - "$out" ${INPROCESS:-59:0 59:-1 0:0} -- ${OTHER:-59} <<'EOF' | tee -a "$out/summary.log"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
split = sys.argv.index("--")
inprocess, other = sys.argv[2:split], sys.argv[split + 1:]
def load(tag):
    try:
        return json.loads((out / f"{tag}.json").read_text())
    except Exception:
        return None
alone = [r["images_per_s"] for r in (load("alone"), load("alone_again")) if r]
base = sum(alone) / len(alone) if alone else float("nan")
print("\n| beside synthetic ResNet-50 training, one H200, no MPS | training images/s | vs alone "
      "| nvJPEG images/s | ms in the call / in the sync, a batch |")
print("|---|---:|---:|---:|---:|")
summary = {"bench": "inprocess_nvjpeg", "alone": round(base)}
print(f"| nothing (mean of the runs before and after) | {base:,.0f} | 100.0 % | | |")
rows = []
for v in inprocess:
    ms, pr = v.split(":")
    pace = f"256 every {ms} ms" if ms != "0" else "back to back"
    rows.append((f"inprocess_{ms}_p{pr}", f"in the training's process, {pace}, stream priority {pr}"))
rows += [(f"otherprocess_{ms}", f"in another process (image_bench), 256 every {ms} ms") for ms in other]
for tag, name in rows:
    r = load(tag)
    if r is None:
        print(f"| {name} | failed | | | |")
        continue
    summary[tag] = {"images_per_s": round(r["images_per_s"]),
                    "vs_alone": round(r["images_per_s"] / base, 4)}
    rate = calls = ""  # another process's rate is in its log (image_bench's progress line)
    if r.get("decode"):
        rate = f"{r['decoded_per_s']:,.0f}"
        calls = f"{r['ms_in_decode_call']:.1f} / {r['ms_in_sync']:.1f}"
        summary[tag]["decoded_per_s"] = round(r["decoded_per_s"])
    print(f"| {name} | {r['images_per_s']:,.0f} | {100 * r['images_per_s'] / base:.1f} % | "
          f"{rate} | {calls} |")
print()
print(json.dumps(summary))
EOF
cp "$out/summary.log" "$final/"
tar -czf "$final/logs.tgz" -C "$out" . 2>/dev/null
