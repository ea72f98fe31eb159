"""Blends and packing with device delivery on one GPU (.ci/device/blend_on_device.sh).
For a blend of windows and for best_fit and concat packing over a blend of three sources of
log-normal documents, the batches a Loader delivers into cuda:0 equal, tensor by tensor and
byte by byte, the batches a Loader with host delivery gets from the same daemon (the reference
path); then the device Loader stops, resumes from its state_dict, and the rest equals too."""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import gpufeed.torch

socket = sys.argv[1]
EOS = 50256
SEQ = 512
work = Path(tempfile.mkdtemp(prefix="gpufeed-blend-device-"))
rng = np.random.default_rng(35)
blend = {}
for name, weight, tokens in (("web", 0.5, 3_000_000), ("code", 0.3, 2_000_000),
                             ("math", 0.2, 1_000_000)):
    lengths = np.clip(rng.lognormal(np.log(300), 1.2, tokens // 200), 2, 20_000).astype(np.int64)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), tokens)]
    body = rng.integers(0, EOS, int(lengths.sum()), dtype=np.uint16)
    body[np.cumsum(lengths) - 1] = EOS
    (work / name).mkdir()
    np.save(work / name / f"{name}.npy", body)
    blend[str(work / name) + "/"] = weight

CASES = {"blend_windows": {}, "best_fit": {"pack": "best_fit", "eos_id": EOS},
         "concat": {"pack": "concat", "eos_id": EOS}}


def loader(device, job, **kw):
    return gpufeed.torch.Loader(blend=blend, kind="tokens", token_dtype="uint16", seq_len=SEQ,
                                batch_size=32, seed=3, device=device, job=job, socket=socket,
                                timeout=60, **kw)


def digests(l, steps, state=None):
    """Per batch: each tensor's sha256 (bytes on the host) and the ids; the state after."""
    if state is not None:
        l.load_state_dict(state)
    out = []
    for b in l:
        row = {"ids": b.ids[: b.valid_count].tolist()}
        for name, t in b.items():
            row[name] = hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()
            row[name + ".device"] = str(t.device)
        out.append(row)
        if len(out) == steps:
            break
    st = l.state_dict()
    l.close()
    return out, st


report = {}
ok = True
for case, kw in CASES.items():
    host, _ = digests(loader("cpu", f"host-{case}", **kw), 200)
    dev, _ = digests(loader("cuda:0", f"dev-{case}", **kw), 200)
    first, st = digests(loader("cuda:0", f"hop-{case}", **kw), 80)
    rest, _ = digests(loader("cuda:0", f"hop-{case}", **kw), 120, st)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith(".device")} for r in rows]
    tensors = sorted(k for k in host[0] if k != "ids" and not k.endswith(".device"))
    on_gpu = all(r[t + ".device"].startswith("cuda") for r in dev for t in tensors)
    equal = strip(dev) == strip(host)
    resumed = strip(first + rest) == strip(host)
    report[case] = {"batches": len(host), "tensors": tensors, "on_gpu": on_gpu,
                    "device_equals_host": equal, "resume_equals": resumed}
    ok = ok and on_gpu and equal and resumed and len(host) == 200
print(json.dumps(report))
sys.exit(0 if ok else 1)
