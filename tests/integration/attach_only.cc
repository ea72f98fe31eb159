// A consumer that attaches and never opens its stream, for the fast-reclaim tests
// (reattach_test.cc, ReclaimTest): it runs the client's own first steps (SessionCore::Attach,
// which passes the dataset with its lifeline, then MapRing when asked), prints
// "attached <session id>" and waits to be killed.
//   attach_only SOCKET TOKENS_FILE [map]
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "client/cpp/rpc.h"
#include "client/cpp/session_core.h"

int main(int argc, char** argv) {
  using gpufeed::client::internal::ChannelFor;
  using gpufeed::client::internal::SessionCore;
  if (argc < 3) {
    std::fprintf(stderr, "usage: attach_only SOCKET TOKENS_FILE [map]\n");
    return 2;
  }
  const std::string socket = argv[1];
  auto core = std::make_shared<SessionCore>(ChannelFor(socket), socket, absl::Seconds(10),
                                            absl::ZeroDuration());
  gpufeed::client::AttachOptions o;
  o.socket = socket;
  o.job = "orphan";
  o.dataset = argv[2];
  o.seq_len = 16;
  o.batch_size = 4;
  auto info = core->Attach(o);
  if (!info.ok()) {
    std::fprintf(stderr, "attach: %s\n", info.status().ToString().c_str());
    return 1;
  }
  if (argc > 3 && std::strcmp(argv[3], "map") == 0) {
    if (absl::Status s = core->MapRing(); !s.ok()) {
      std::fprintf(stderr, "map: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  std::printf("attached %llu\n", static_cast<unsigned long long>(info->session_id));
  std::fflush(stdout);
  while (true) ::pause();
}
