/* The C ABI used from C: attach, read three batches, check their ids against the epoch order
 * computed here and the payload against the file, check error reporting, detach.
 * With a third argument, a WebDataset shard directory whose one shard holds the keys
 * img.001 and img.002 (one key, img, without an image) among others: its notice.
 * Usage: c_api_test SOCKET TOKENS_FILE [WEBDATASET_DIR] (tokens: uint16, seq_len 16). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpufeed/gpufeed.h"

#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      fprintf(stderr, "FAILED %s: ", #cond); \
      fprintf(stderr, __VA_ARGS__);       \
      fprintf(stderr, "\n");              \
      return 1;                           \
    }                                     \
  } while (0)

/* The epoch order of the README's contract ("feistel1"), written again here from that text
 * (as tests/python/reference.py is): a 4-round Feistel bijection keyed by (seed, epoch) over
 * the smallest even-bit power-of-two domain >= n, restricted to [0, n) by cycle walking. */
static uint64_t fmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

static uint64_t splitmix64(uint64_t* state) {
  *state += 0x9E3779B97F4A7C15ULL;
  return fmix64(*state);
}

/* Sample id at position i of the epoch; n >= 2, shuffled. */
static uint64_t epoch_order_at(uint64_t n, uint64_t seed, int64_t epoch, uint64_t i) {
  int bits = 1;
  while (bits < 64 && (UINT64_C(1) << bits) < n) ++bits;
  bits += bits & 1;
  const int half = bits / 2;
  const uint64_t mask = (UINT64_C(1) << half) - 1;
  uint64_t state = seed;
  state = splitmix64(&state) ^ (uint64_t)epoch;
  uint64_t keys[4];
  for (int k = 0; k < 4; ++k) keys[k] = splitmix64(&state);
  uint64_t x = i;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (int k = 0; k < 4; ++k) {
      const uint64_t next = left ^ (fmix64(right + keys[k]) & mask);
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= n);
  return x;
}

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    fprintf(stderr, "usage: %s SOCKET TOKENS_FILE [WEBDATASET_DIR]\n", argv[0]);
    return 2;
  }
  FILE* f = fopen(argv[2], "rb");
  CHECK(f != NULL, "cannot open %s", argv[2]);
  static uint16_t tokens[1 << 20];
  size_t count = fread(tokens, 2, sizeof(tokens) / 2, f);
  fclose(f);
  CHECK(count > 100, "short tokens file");

  CHECK(gpufeed_api_version() == GPUFEED_API_VERSION, "api version %u", gpufeed_api_version());

  gpufeed_options* options = NULL;
  CHECK(gpufeed_options_create(&options) == GPUFEED_OK, "options");
  CHECK(gpufeed_options_set_string(options, "no_such_key", "x") == GPUFEED_INVALID_ARGUMENT,
        "unknown key accepted");
  CHECK(strstr(gpufeed_last_error(), "no_such_key") != NULL, "message: %s", gpufeed_last_error());

  /* A blend and a pack mode: keys checked where they are set, then the sources expanded at
   * attach, before anything is sent (a source of no file is refused naming it). */
  gpufeed_options* blend = NULL;
  CHECK(gpufeed_options_create(&blend) == GPUFEED_OK, "options");
  CHECK(gpufeed_options_set_string(blend, "pack", "fit") == GPUFEED_INVALID_ARGUMENT,
        "pack fit accepted");
  CHECK(strcmp(gpufeed_last_error(), "pack: want none, concat or best_fit, got 'fit'") == 0,
        "message: %s", gpufeed_last_error());
  CHECK(gpufeed_options_set_string(blend, "pack", "best_fit") == GPUFEED_OK, "pack best_fit");
  CHECK(gpufeed_options_set_int(blend, "eos_id", 50256) == GPUFEED_OK, "eos_id");
  CHECK(gpufeed_options_set_int(blend, "pack_lookahead", 64) == GPUFEED_OK, "pack_lookahead");
  CHECK(gpufeed_options_add_blend_source(blend, "/nonexistent/web/", -1) ==
            GPUFEED_INVALID_ARGUMENT,
        "weight -1 accepted");
  CHECK(strcmp(gpufeed_last_error(),
               "blend[0] '/nonexistent/web/': weight must be > 0 and finite, got -1") == 0,
        "message: %s", gpufeed_last_error());
  CHECK(gpufeed_options_set_string(blend, "blend_history_json",
                                   "[{\"start\": 0, \"weights\": [1]}]") ==
            GPUFEED_INVALID_ARGUMENT,
        "a segment without a ledger accepted");
  CHECK(strcmp(gpufeed_last_error(), "blend_history[0]: no 'ledger'") == 0, "message: %s",
        gpufeed_last_error());
  CHECK(gpufeed_options_set_string(blend, "blend_history_json",
                                   "[{\"start\": 0, \"weights\": [1], \"ledger\": [0]}]") ==
            GPUFEED_OK,
        "blend_history_json: %s", gpufeed_last_error());
  CHECK(gpufeed_options_add_blend_source(blend, "/nonexistent/web/", 0.7) == GPUFEED_OK,
        "blend source: %s", gpufeed_last_error());
  gpufeed_options_set_string(blend, "socket", argv[1]);
  gpufeed_options_set_int(blend, "seq_len", 16);
  gpufeed_options_set_int(blend, "batch_size", 4);
  gpufeed_session* none = NULL;
  CHECK(gpufeed_attach(blend, &none) == GPUFEED_NOT_FOUND && none == NULL,
        "a blend of a missing source attached: %s", gpufeed_last_error());
  CHECK(strcmp(gpufeed_last_error(), "blend[0] '/nonexistent/web/': No such file or directory") ==
            0,
        "message: %s", gpufeed_last_error());
  gpufeed_options_destroy(blend);

  gpufeed_options_set_string(options, "socket", argv[1]);
  gpufeed_options_set_string(options, "job", "c-abi");
  gpufeed_options_set_string(options, "kind", "tokens");
  gpufeed_options_set_string(options, "dataset", argv[2]);
  gpufeed_options_set_string(options, "token_dtype", "uint16");
  gpufeed_options_set_int(options, "seq_len", 16);
  gpufeed_options_set_int(options, "batch_size", 0);

  gpufeed_session* session = NULL;
  /* batch_size 0 is refused by the daemon with a code and a message naming the field. */
  CHECK(gpufeed_attach(options, &session) == GPUFEED_INVALID_ARGUMENT, "batch_size 0 accepted");
  CHECK(session == NULL, "session set on failure");
  CHECK(strstr(gpufeed_last_error(), "batch_size") != NULL, "message: %s", gpufeed_last_error());

  gpufeed_options_set_int(options, "batch_size", 4);
  gpufeed_options_set_int(options, "seed", 3);
  CHECK(gpufeed_options_set_string(options, "elastic", "keep") == GPUFEED_INVALID_ARGUMENT,
        "elastic keep accepted");
  CHECK(strcmp(gpufeed_last_error(), "elastic: want global_batch or rank_batch, got 'keep'") == 0,
        "message: %s", gpufeed_last_error());
  CHECK(gpufeed_attach(options, &session) == GPUFEED_OK, "attach: %s", gpufeed_last_error());
  int64_t served = -1;
  CHECK(gpufeed_session_batch_size(session, &served) == GPUFEED_OK && served == 4,
        "batch size served %ld", (long)served);

  gpufeed_session_info info;
  CHECK(gpufeed_session_get_info(session, &info) == GPUFEED_OK, "info");
  CHECK(info.num_tensors == 1, "num_tensors %d", info.num_tensors);
  CHECK(info.num_samples == (int64_t)((count - 1) / 16), "num_samples %ld", (long)info.num_samples);
  /* Nothing was left out of the token file: no notice, and index 0 is out of range. */
  int32_t notices = -1;
  CHECK(gpufeed_session_notice_count(session, &notices) == GPUFEED_OK && notices == 0, "notices %d",
        notices);
  gpufeed_notice notice;
  CHECK(gpufeed_session_get_notice(session, 0, &notice) == GPUFEED_OUT_OF_RANGE, "notice 0");
  CHECK(strstr(gpufeed_last_error(), "notice index 0") != NULL, "message: %s",
        gpufeed_last_error());

  for (int b = 0; b < 3; ++b) {
    gpufeed_batch* batch = NULL;
    CHECK(gpufeed_next(session, 10000, &batch) == GPUFEED_OK, "next: %s", gpufeed_last_error());
    gpufeed_batch_info bi;
    CHECK(gpufeed_batch_get_info(batch, &bi) == GPUFEED_OK, "batch info");
    CHECK(bi.step == b && bi.epoch == 0 && bi.batch_size == 4 && bi.valid_count == 4,
          "batch %d: epoch %ld step %ld", b, (long)bi.epoch, (long)bi.step);
    gpufeed_tensor t;
    CHECK(gpufeed_batch_get_tensor(batch, 0, &t) == GPUFEED_OK, "tensor");
    CHECK(strcmp(t.name, "tokens") == 0 && t.dtype == GPUFEED_DTYPE_UINT16 && t.ndim == 2 &&
              t.shape[0] == 4 && t.shape[1] == 17 && t.device_type == GPUFEED_DEVICE_CPU,
          "layout");
    /* One rank, seed 3: batch b is epoch positions 4b .. 4b + 3. */
    for (int r = 0; r < 4; ++r) {
      const int64_t want = (int64_t)epoch_order_at((uint64_t)info.num_samples, 3, 0, 4 * b + r);
      CHECK(bi.ids[r] == want, "batch %d row %d: id %ld, the epoch order says %ld", b, r,
            (long)bi.ids[r], (long)want);
    }
    for (int r = 0; r < 4; ++r) {
      const uint16_t* row = (const uint16_t*)t.data + r * 17;
      CHECK(memcmp(row, tokens + bi.ids[r] * 16, 17 * 2) == 0, "row %d of batch %d differs", r, b);
    }
    CHECK(gpufeed_batch_get_tensor(batch, 1, &t) == GPUFEED_OUT_OF_RANGE, "tensor 1");
    int64_t after_epoch = -1, after_step = -1, after_samples = -1;
    CHECK(gpufeed_batch_after(batch, &after_epoch, &after_step, &after_samples) == GPUFEED_OK &&
              after_epoch == 0 && after_step == b + 1 && after_samples == 4 * (b + 1),
          "after batch %d: (%ld, %ld, %ld)", b, (long)after_epoch, (long)after_step,
          (long)after_samples);
    gpufeed_batch_release(batch);
  }
  int64_t epoch = -1, step = -1, samples = -1;
  CHECK(gpufeed_position(session, &epoch, &step) == GPUFEED_OK && epoch == 0 && step == 3,
        "position (%ld, %ld)", (long)epoch, (long)step);
  CHECK(gpufeed_position_samples(session, &samples) == GPUFEED_OK && samples == 12,
        "position's samples %ld", (long)samples);
  const char* segments = NULL;  /* no blend: none */
  CHECK(gpufeed_session_blend_segments_json(session, &segments) == GPUFEED_OK &&
            strcmp(segments, "[]") == 0,
        "blend segments %s", segments ? segments : "(null)");
  const char* saved = NULL;
  CHECK(gpufeed_fingerprint(session, &saved) == GPUFEED_OK, "fingerprint");
  char fingerprint[4096];
  CHECK(strlen(saved) < sizeof(fingerprint), "fingerprint of %zu bytes", strlen(saved));
  strcpy(fingerprint, saved);
  CHECK(gpufeed_detach(session) == GPUFEED_OK, "detach: %s", gpufeed_last_error());
  gpufeed_session_destroy(session);

  /* Rank 0 of 2 resumes the one-rank job's position keeping the global batch of 4: asking
   * for the saved per-rank batch, it is served 2 a step, epoch positions 12 and 13 first. */
  gpufeed_options_set_int(options, "world_size", 2);
  gpufeed_options_set_int(options, "start_epoch", epoch);
  gpufeed_options_set_int(options, "start_step", step);
  gpufeed_options_set_int(options, "start_samples", samples);
  gpufeed_options_set_string(options, "start_fingerprint", fingerprint);
  gpufeed_options_set_string(options, "elastic", "global_batch");
  CHECK(gpufeed_attach(options, &session) == GPUFEED_OK, "elastic attach: %s",
        gpufeed_last_error());
  gpufeed_options_destroy(options);
  CHECK(gpufeed_session_batch_size(session, &served) == GPUFEED_OK && served == 2,
        "elastic batch size served %ld", (long)served);
  gpufeed_batch* resumed = NULL;
  CHECK(gpufeed_next(session, 10000, &resumed) == GPUFEED_OK, "next: %s", gpufeed_last_error());
  gpufeed_batch_info ri;
  CHECK(gpufeed_batch_get_info(resumed, &ri) == GPUFEED_OK && ri.batch_size == 2 &&
            ri.epoch == 0 && ri.step == 3,
        "resumed batch: epoch %ld step %ld rows %ld", (long)ri.epoch, (long)ri.step,
        (long)ri.batch_size);
  for (int r = 0; r < 2; ++r) {
    const int64_t want = (int64_t)epoch_order_at((uint64_t)info.num_samples, 3, 0, 12 + r);
    CHECK(ri.ids[r] == want, "resumed row %d: id %ld, the epoch order says %ld", r,
          (long)ri.ids[r], (long)want);
  }
  gpufeed_batch_release(resumed);
  CHECK(gpufeed_detach(session) == GPUFEED_OK, "detach: %s", gpufeed_last_error());
  gpufeed_session_destroy(session);

  if (argc == 4) {
    CHECK(gpufeed_options_create(&options) == GPUFEED_OK, "options");
    gpufeed_options_set_string(options, "socket", argv[1]);
    gpufeed_options_set_string(options, "job", "c-abi-notices");
    gpufeed_options_set_string(options, "kind", "webdataset");
    gpufeed_options_set_string(options, "dataset", argv[3]);
    gpufeed_options_set_string(options, "pipeline_json", "{\"ops\": [{\"center_crop\": 4}]}");
    gpufeed_options_set_int(options, "batch_size", 1);
    CHECK(gpufeed_attach(options, &session) == GPUFEED_OK, "attach webdataset: %s",
          gpufeed_last_error());
    gpufeed_options_destroy(options);
    CHECK(gpufeed_session_notice_count(session, &notices) == GPUFEED_OK && notices == 1,
          "webdataset notices %d", notices);
    CHECK(gpufeed_session_get_notice(session, 0, &notice) == GPUFEED_OK, "notice 0: %s",
          gpufeed_last_error());
    CHECK(strcmp(notice.reason, "no_image") == 0 && notice.count == 1, "notice %s %ld",
          notice.reason, (long)notice.count);
    const size_t n = strlen(notice.example);
    CHECK(n > 4 && strcmp(notice.example + n - 4, ":img") == 0, "example %s", notice.example);
    CHECK(strstr(notice.message, "img.001.jpg is key img with extension 001.jpg") != NULL,
          "message %s", notice.message);
    CHECK(gpufeed_session_get_notice(session, -1, &notice) == GPUFEED_OUT_OF_RANGE, "notice -1");
    CHECK(gpufeed_detach(session) == GPUFEED_OK, "detach: %s", gpufeed_last_error());
    gpufeed_session_destroy(session);
  }
  printf("c api ok\n");
  return 0;
}
