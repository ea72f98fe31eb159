// EscapeForLog: a caller-supplied string can neither end a log line nor send terminal escapes.
#include "common/logging.h"

#include <string>

#include "gtest/gtest.h"

namespace gpufeed {
namespace {

TEST(EscapeForLogTest, KeepsPrintableAsciiAndEscapesTheRest) {
  EXPECT_EQ(EscapeForLog("train-v2/rank:0@node"), "train-v2/rank:0@node");
  EXPECT_EQ(EscapeForLog("/data/my set/it's \"x\""), "/data/my set/it's \"x\"");
  EXPECT_EQ(EscapeForLog("a\nINFO forged"), "a\\nINFO forged");
  EXPECT_EQ(EscapeForLog("\r\t\\"), "\\r\\t\\\\");
  EXPECT_EQ(EscapeForLog("\x1b[31mred"), "\\x1b[31mred");
  EXPECT_EQ(EscapeForLog(std::string("nul\0byte", 8)), "nul\\x00byte");
  EXPECT_EQ(EscapeForLog("\x7f caf\xc3\xa9"), "\\x7f caf\\xc3\\xa9");
  EXPECT_EQ(EscapeForLog(""), "");
}

TEST(EscapeForLogTest, LongInputIsCut) {
  EXPECT_EQ(EscapeForLog(std::string(600, 'a')), std::string(512, 'a') + "...");
  EXPECT_EQ(EscapeForLog("abcdef", 3), "abc...");
  EXPECT_EQ(EscapeForLog("abc", 3), "abc");
  EXPECT_EQ(EscapeForLog("\n\n\n\n", 2), "\\n\\n...");
}

}  // namespace
}  // namespace gpufeed
