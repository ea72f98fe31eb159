"""Elastic resume with device delivery on one GPU (.ci/device/elastic_on_device.sh).

Four Loaders (ranks 0..3 of one job, all on cuda:0) read an image folder in lockstep; the job
stops, and resumes (a) at 2 ranks keeping the global batch: every global batch's bytes (the
ranks' image tensors in rank order, CPU decode + the GPU kernel) equal the uninterrupted
run's; (b) at 3 ranks keeping the per-rank batch (drop_last False): each sample of the epoch
exactly once; (c) as (a) with nvJPEG (decode auto): the ids of every global batch equal."""
import hashlib
import json
import sys

import torch

import gpufeed.torch

data, socket = sys.argv[1:3]
PIPE = [{"random_resized_crop": {"size": 160}}, {"flip": {"p": 0.5}},
        {"normalize": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}}]


def loaders(world, job, batch=32, **kw):
    return [gpufeed.torch.Loader(data, kind="image_folder", batch_size=batch, seed=5,
                                 pipeline=PIPE, device="cuda:0", rank=r, world_size=world,
                                 job=job, socket=socket, timeout=60, **kw)
            for r in range(world)]


def run(ls, steps, state=None):
    """`steps` global batches (None: to the epoch's end) in lockstep; per step the digest of
    the ranks' image bytes, the ids, and rank 0's state after."""
    if state is not None:
        for l in ls:
            l.load_state_dict(state)
    its = [iter(l) for l in ls]
    out = []
    while steps is None or len(out) < steps:
        try:
            bs = [next(it) for it in its]
        except StopIteration:
            break
        h = hashlib.sha256()
        ids = []
        for b in bs:
            h.update(b["image"].contiguous().cpu().numpy().tobytes())
            ids.append(b.ids[: b.valid_count].tolist())
        out.append((h.hexdigest(), ids))
    st = ls[0].state_dict()
    for l in ls:
        l.close()
    return out, st


report = {}
for decode in ("cpu", "auto"):
    straight, _ = run(loaders(4, f"straight-{decode}", decode=decode), None)
    first, st = run(loaders(4, f"hop-{decode}", decode=decode), 6)
    rest, _ = run(loaders(2, f"hop-{decode}", decode=decode), None, st)
    flat = lambda ids: [i for r in ids for i in r]
    same_ids = [flat(a[1]) for a in straight] == [flat(a[1]) for a in first + rest]
    same_bytes = [a[0] for a in straight] == [a[0] for a in first + rest]
    report[f"global_batch_4_to_2_{decode}"] = {
        "steps": len(straight), "ids_equal": same_ids, "bytes_equal": same_bytes}

first, st = run(loaders(4, "rank", drop_last=False), 5)
rest, _ = run(loaders(3, "rank", drop_last=False, elastic="rank_batch"), None, st)
ids = sorted(i for step in first + rest for r in step[1] for i in r)
report["rank_batch_4_to_3"] = {"delivered": len(ids), "distinct": len(set(ids)),
                               "exactly_once": len(ids) == len(set(ids)) and
                               ids == list(range(len(ids)))}
print(json.dumps(report))
ok = all(v.get("ids_equal", True) and v.get("exactly_once", True) for v in report.values()) \
    and report["global_batch_4_to_2_cpu"]["bytes_equal"]
sys.exit(0 if ok else 1)
