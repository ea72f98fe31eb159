"""Does nvJPEG's hardware decode cost a training process less when it runs in that process's
own CUDA context? (the daemon's nvJPEG work, in its own context, costs ResNet-50 on
the same GPU ~33 us an image without MPS: the GPU time-slices the two contexts.)

Trains a synthetic ResNet-50 as client/python/examples/train_ddp.py --loader synthetic does
(bf16 autocast, channels_last, SGD, one batch already on the GPU) and, with --decode, decodes
JPEGs with nvJPEG's hardware backend (batched, RGBI) on a second stream of the same process,
in a thread, one batch every --step-ms: the work a consumer-side decode would add to the
training's own context. Prints one JSON line: the training's images/s and the images decoded.

    python3 inprocess_nvjpeg_probe.py --data DIR [--decode] [--step-ms 59] [--steps 200]

nvJPEG is called through ctypes (its C ABI; the library from $GPUFEED_NVJPEG_LIBRARY or
libnvjpeg.so.13), so the probe needs nothing built. A measurement tool, not part of gpufeed.
"""
import argparse
import ctypes
import json
import os
import threading
import time

import torch

HARDWARE = 3  # NVJPEG_BACKEND_HARDWARE
RGBI = 5  # NVJPEG_OUTPUT_RGBI


class Image(ctypes.Structure):  # nvjpegImage_t
    _fields_ = [("channel", ctypes.c_void_p * 4), ("pitch", ctypes.c_size_t * 4)]


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: nvJPEG status {rc}")


class Decoder:
    """nvjpegDecodeBatched of `batch` files at a time on `stream`: batches of consecutive
    files, used in turn."""

    def __init__(self, paths, batch, stream):
        lib = os.environ.get("GPUFEED_NVJPEG_LIBRARY") or "libnvjpeg.so.13"
        self.nv = ctypes.CDLL(lib)
        self.handle, self.state = ctypes.c_void_p(), ctypes.c_void_p()
        check(self.nv.nvjpegCreateEx(HARDWARE, None, None, 0, ctypes.byref(self.handle)),
              "nvjpegCreateEx(hardware)")
        check(self.nv.nvjpegJpegStateCreate(self.handle, ctypes.byref(self.state)),
              "nvjpegJpegStateCreate")
        check(self.nv.nvjpegDecodeBatchedInitialize(self.handle, self.state, batch, 1, RGBI),
              "nvjpegDecodeBatchedInitialize")
        files = [open(p, "rb").read() for p in paths]
        # Every file in one pinned buffer, as the daemon's staging slots are.
        self.pinned = torch.empty(sum(len(f) for f in files), dtype=torch.uint8, pin_memory=True)
        pointers, sizes, at = [], [], 0
        for f in files:
            self.pinned[at:at + len(f)] = torch.frombuffer(bytearray(f), dtype=torch.uint8)
            pointers.append(self.pinned.data_ptr() + at)
            comps, sub = ctypes.c_int(), ctypes.c_int()
            w, h = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
            check(self.nv.nvjpegGetImageInfo(self.handle, ctypes.c_void_p(pointers[-1]),
                                             ctypes.c_size_t(len(f)), ctypes.byref(comps),
                                             ctypes.byref(sub), w, h), "nvjpegGetImageInfo")
            sizes.append((h[0], w[0]))
            at += len(f)
        self.batch, self.stream = batch, stream
        biggest = max(h * w * 3 for h, w in sizes)
        self.out = torch.empty((batch, biggest), dtype=torch.uint8, device="cuda")
        # The calls' arguments, built once (batches of consecutive files, used in turn): the
        # thread then holds the GIL only to make the two calls.
        self.calls = []
        for start in range(0, len(sizes) - batch + 1, batch):
            idx = range(start, start + batch)
            images = (Image * batch)()
            for row, i in enumerate(idx):
                images[row].channel[0] = self.out[row].data_ptr()
                images[row].pitch[0] = sizes[i][1] * 3
            self.calls.append(((ctypes.c_void_p * batch)(*[pointers[i] for i in idx]),
                               (ctypes.c_size_t * batch)(*[len(files[i]) for i in idx]),
                               images))
        if not self.calls:
            raise SystemExit(f"--files: fewer than {batch} JPEGs")
        self.next = 0
        self.decoded = 0
        self.decode_s = 0.0  # in nvjpegDecodeBatched
        self.sync_s = 0.0  # waiting for the stream after it

    def decode_one_batch(self):
        data, lengths, images = self.calls[self.next]
        self.next = (self.next + 1) % len(self.calls)
        t0 = time.perf_counter()
        check(self.nv.nvjpegDecodeBatched(self.handle, self.state, data, lengths, images,
                                          ctypes.c_void_p(self.stream.cuda_stream)),
              "nvjpegDecodeBatched")
        t1 = time.perf_counter()
        # As gpufeedd does: the previous call's stream work ends before the next call
        # (back-to-back calls can spin for ever in nvJPEG 13.0; docs/ARCHITECTURE.md).
        self.stream.synchronize()
        self.decode_s += t1 - t0
        self.sync_s += time.perf_counter() - t1
        self.decoded += self.batch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a folder of JPEGs (searched recursively)")
    p.add_argument("--decode", action="store_true", help="decode beside the training, in-process")
    p.add_argument("--step-ms", type=float, default=59.0, help="one decode batch every MS")
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--priority", type=int, default=0,
                   help="the decode stream's priority (torch: lower is higher; -1 high)")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch", type=int, default=256)
    args = p.parse_args()
    import torchvision  # here, so that --help works where it is absent

    device = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50(num_classes=1000).to(device)
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(args.batch, 3, 224, 224, device=device).to(
        memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch,), device=device)

    stop = threading.Event()
    decoder = None
    thread = None
    if args.decode:
        paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(args.data) for f in fs
                       if f.endswith(".jpg"))[:args.files]
        decoder = Decoder(paths, args.decode_batch,
                          torch.cuda.Stream(device=device, priority=args.priority))

        def pace():
            t = time.perf_counter()
            while not stop.is_set():
                decoder.decode_one_batch()
                t += args.step_ms / 1000
                time.sleep(max(0.0, t - time.perf_counter()))

        decoder.decode_one_batch()  # warm
        thread = threading.Thread(target=pace, daemon=True)
        thread.start()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    decoded0 = decoder.decoded if decoder else 0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    decoded = (decoder.decoded - decoded0) if decoder else 0
    calls = decoder.decoded / decoder.batch if decoder else 0
    stop.set()
    if thread:
        thread.join()
    print(json.dumps({"probe": "inprocess_nvjpeg", "decode": args.decode,
                      "images_per_s": args.steps * args.batch / seconds,
                      "step_ms": 1000 * seconds / args.steps,
                      "decoded_per_s": decoded / seconds, "priority": args.priority,
                      "ms_in_decode_call": 1000 * decoder.decode_s / calls if calls else 0,
                      "ms_in_sync": 1000 * decoder.sync_s / calls if calls else 0}))


if __name__ == "__main__":
    main()
