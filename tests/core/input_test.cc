// User input (issue 16): strict numbers, printable messages, files that are not regular files,
// outputs that are not regular files, JSON nested too deep, and visibleEntries past int64.
#include "fcp/core/input.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>

#include "fcp/core/cost_model.h"
#include "fcp/core/error.h"
#include "fcp/core/units.h"
#include "fcp/core/workload.h"
#include "../common/error_of.h"

namespace fcp {
namespace {

using fcp::testing::errorOf;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// A fresh directory under the test temp dir.
std::string freshDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "fcp_input_test_" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(InputTest, IntegersAreStrict) {
  EXPECT_EQ(parseInteger("16", "--workers", 1, 100), 16);
  EXPECT_EQ(parseInteger("-4", "--x", -10, 10), -4);
  for (const char* bad : {"", " 16", "16 ", "+16", "16,", "1e3", "0x10", "16K", "--16", "abc"}) {
    EXPECT_TRUE(contains(errorOf([&] { parseInteger(bad, "--workers", 1, 100); }), "--workers"))
        << bad;
  }
  EXPECT_TRUE(contains(errorOf([] { parseInteger("99999999999999999999", "--workers", 1, 100); }),
                       "an integer from 1 to 100"));
  EXPECT_TRUE(contains(errorOf([] { parseInteger("101", "--workers", 1, 100); }), "'101'"));
  EXPECT_TRUE(contains(errorOf([] { parseInteger("0", "--workers", 1, 100); }), "'0'"));
}

TEST(InputTest, UnsignedRefusesMinusOneAndOverflow) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  EXPECT_EQ(parseUnsigned("18446744073709551615", "--seed", kMax), kMax);
  EXPECT_EQ(parseUnsigned("0", "--seed", kMax), 0u);
  EXPECT_TRUE(contains(errorOf([] { parseUnsigned("-1", "--seed", kMax); }), "--seed '-1'"));
  EXPECT_TRUE(contains(errorOf([] { parseUnsigned("99999999999999999999", "--seed", kMax); }),
                       "'99999999999999999999'"));
  EXPECT_TRUE(contains(errorOf([] { parseUnsigned("", "--seed", kMax); }), "--seed ''"));
}

TEST(InputTest, NumbersAreFiniteAndInRange) {
  EXPECT_DOUBLE_EQ(parseNumber("0.25", "--x", 0, 1), 0.25);
  EXPECT_DOUBLE_EQ(parseNumber("1e-3", "--x", 0, 1), 1e-3);
  EXPECT_DOUBLE_EQ(parseNumber("-1", "--x", -1, 1), -1);
  for (const char* bad : {"", "inf", "-inf", "nan", "infinity", "1e400", "2", "-0.5", "0.5x",
                          " 0.5", "1,5"}) {
    EXPECT_TRUE(contains(errorOf([&] { parseNumber(bad, "--x", 0, 1); }), "a finite number from 0"))
        << bad;
  }
  EXPECT_TRUE(contains(errorOf([] { parseNumber("1e30", "--comm-ratio", 0, 1e5); }),
                       "--comm-ratio '1e30'"));
}

TEST(InputTest, PrintableEscapesControlBytesBomAndBadUtf8) {
  EXPECT_EQ(printable("plain text"), "plain text");
  EXPECT_EQ(printable(std::string("a\0b", 3)), "a\\0b");
  EXPECT_EQ(printable("a\rb\nc\td\x7f"), "a\\rb\\nc\\td\\x7F");
  EXPECT_EQ(printable("\xEF\xBB\xBF" "4096"), "\\uFEFF4096");
  EXPECT_EQ(printable("\xff\xfe"), "\\xFF\\xFE");
  EXPECT_EQ(printable("caf\xC3\xA9 \xCE\x94"), "caf\xC3\xA9 \xCE\x94");  // valid UTF-8 stays
  EXPECT_EQ(printable("\xC0\xAF"), "\\xC0\\xAF");                      // an overlong '/'
  EXPECT_EQ(printable("\xED\xA0\x80"), "\\xED\\xA0\\x80");             // a surrogate
  const std::string longLine(10 << 20, '7');
  const std::string cut = printable(longLine);
  EXPECT_EQ(cut.size(), kMaxEchoedChars + 3);
  EXPECT_EQ(cut.substr(cut.size() - 3), "...");
}

TEST(InputTest, ErrorMessagesAreOnePrintableLine) {
  const Error e(ErrorCode::kInvalidArgument, std::string("bad '\0x\nnext' line", 18));
  const std::string what = e.what();
  EXPECT_EQ(what, "bad '\\0x\\nnext' line");
  const Error big(ErrorCode::kInvalidArgument, std::string(1 << 20, 'x'));
  EXPECT_LE(std::string(big.what()).size(), kMaxErrorMessageChars + 3);
}

TEST(InputTest, ReadUserFileRefusesWhatIsNotARegularFile) {
  const std::string dir = freshDir("read");
  EXPECT_TRUE(contains(errorOf([&] { readUserFile(dir, "--plan-in file", 100); }),
                       "it is a directory, expected a regular file"));
  EXPECT_TRUE(contains(errorOf([] { readUserFile("/dev/zero", "--plan-in file", 100); }),
                       "it is a character device"));
  // A FIFO with no writer: refused at once, not waited on.
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_TRUE(contains(errorOf([&] { readUserFile(fifo, "trace file", 100); }), "it is a FIFO"));
  EXPECT_TRUE(contains(errorOf([&] { readUserFile(dir + "/none", "trace file", 100); }),
                       "cannot read trace file"));
  const std::string big = dir + "/big";
  std::ofstream(big) << std::string(101, 'x');
  EXPECT_TRUE(contains(errorOf([&] { readUserFile(big, "trace file", 100); }),
                       "is 101 bytes: expected at most 100"));
  const std::string ok = dir + "/ok";
  std::ofstream(ok) << "hello";
  EXPECT_EQ(readUserFile(ok, "trace file", 100), "hello");
}

TEST(InputTest, WriteUserFileWritesOnlyRegularFilesOrNewPaths) {
  const std::string dir = freshDir("write");
  const std::string fresh = dir + "/plan.json";
  writeUserFile(fresh, "--plan-out file", "one");
  writeUserFile(fresh, "--plan-out file", "two");  // a regular file is replaced
  EXPECT_EQ(readUserFile(fresh, "x", 100), "two");
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string link = dir + "/link";
  std::filesystem::create_symlink(fresh, link);
  EXPECT_TRUE(contains(errorOf([&] { writeUserFile(fifo, "--plan-out file", "x"); }), "a FIFO"));
  EXPECT_TRUE(contains(errorOf([&] { writeUserFile(link, "--plan-out file", "x"); }),
                       "a symbolic link"));
  EXPECT_TRUE(contains(errorOf([&] { writeUserFile(dir, "--plan-out file", "x"); }), "a directory"));
  EXPECT_TRUE(contains(errorOf([] { writeUserFile("/dev/null", "--plan-out file", "x"); }),
                       "a character device"));
  // Nothing was replaced, and no temporary file was left behind.
  struct stat st {};
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  ASSERT_EQ(::lstat(link.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  ASSERT_EQ(::lstat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            3);
}

TEST(InputTest, AnOutputPathWhoseDirectoryCannotTakeItIsRefusedBeforeTheWork) {
  // `fcp run --timeline nodir/t.json` ran the whole job and then failed to write (a review).
  const std::string dir = freshDir("output_dir");
  EXPECT_TRUE(contains(errorOf([&] { checkOutputPath(dir + "/none/t.json", "--timeline file"); }),
                       "cannot write --timeline file '" + dir + "/none/t.json': its directory '" +
                           dir +
                           "/none': No such file or directory, expected an existing directory"));
  const std::string file = dir + "/file";
  std::ofstream(file) << "x";
  EXPECT_TRUE(contains(errorOf([&] { checkOutputPath(file + "/t.json", "--plan-out file"); }),
                       "Not a directory"));
  checkOutputPath(dir + "/new.json", "--plan-out file");  // a new file in a directory: fine
  checkOutputPath(file, "--plan-out file");               // a regular file to replace: fine
  const std::string cwd = std::filesystem::current_path().string();
  std::filesystem::current_path(dir);
  checkOutputPath("bare.json", "--plan-out file");  // no directory named: the current one
  std::filesystem::current_path(cwd);
}

TEST(InputTest, JsonDepthIsBounded) {
  const auto nested = [](int depth) {
    return std::string(static_cast<size_t>(depth), '[') + std::string(static_cast<size_t>(depth), ']');
  };
  checkJsonDepth(nested(kMaxJsonDepth), "f");
  EXPECT_TRUE(contains(errorOf([&] { checkJsonDepth(nested(kMaxJsonDepth + 1), "plan.json"); }),
                       "plan.json: JSON nests"));
  EXPECT_TRUE(contains(errorOf([&] { checkJsonDepth(nested(100000), "f"); }), "more than 64"));
  // Brackets inside strings (and escaped quotes) do not count.
  checkJsonDepth("{\"a\": \"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"}", "f");
}

TEST(InputTest, TraceNamesTheLineOfAnOverlongLengthAndEscapesWhatItEchoes) {
  const std::string dir = freshDir("trace");
  const std::string longLength = dir + "/long.txt";
  std::ofstream(longLength) << "4096\n# comment\n1073741825\n";
  EXPECT_TRUE(contains(errorOf([&] { readTrace(longLength); }),
                       "line 3: sequence length 1073741825 is over the limit"));
  const std::string nul = dir + "/nul.txt";
  std::ofstream(nul) << std::string("40\0" "96\n", 6);
  const std::string message = errorOf([&] { readTrace(nul); });
  EXPECT_TRUE(contains(message, "line 1: '40\\096' is not")) << message;
  const std::string bom = dir + "/bom.txt";
  std::ofstream(bom) << "\xEF\xBB\xBF" "4096\n";
  EXPECT_TRUE(contains(errorOf([&] { readTrace(bom); }), "'\\uFEFF4096'"));
  const std::string cr = dir + "/cr.txt";
  std::ofstream(cr) << "4096\r8192\n";
  EXPECT_TRUE(contains(errorOf([&] { readTrace(cr); }), "'4096\\r8192'"));
  const std::string longLine = dir + "/longline.txt";
  std::ofstream(longLine) << std::string(10 << 20, '9') << "x\n";
  const std::string cut = errorOf([&] { readTrace(longLine); });
  EXPECT_LT(cut.size(), 300u);
  EXPECT_TRUE(contains(cut, "line 1: '999")) << cut;
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_TRUE(contains(errorOf([&] { readTrace(fifo); }), "it is a FIFO"));
}

TEST(InputTest, TokenCountEchoIsCut) {
  const std::string message = errorOf([] { parseTokenCount(std::string(100000, 'x'), "--block-size"); });
  EXPECT_LT(message.size(), 300u);
}

TEST(CostModelOverflowTest, VisibleEntriesSaturateInsteadOfOverflowing) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t big = int64_t{1} << 40;
  EXPECT_EQ(visibleEntries(MaskKind::kFull, 0, big, 0, big), kMax);
  EXPECT_EQ(visibleEntries(MaskKind::kCausal, 0, big, 0, big), kMax);
  EXPECT_EQ(visibleEntries(MaskKind::kCausal, big, 2 * big, 0, big), kMax);
  EXPECT_EQ(visibleEntries(MaskKind::kFull, std::numeric_limits<int64_t>::min(), kMax, 0, 2), kMax);
  // Near the limit the counts stay exact: a 2^31-token causal sequence, 2^31 (2^31 + 1) / 2.
  const int64_t n = int64_t{1} << 31;
  EXPECT_EQ(visibleEntries(MaskKind::kCausal, 0, n, 0, n), n / 2 * (n + 1));
  EXPECT_EQ(visibleEntries(MaskKind::kFull, 0, n, 0, n), n * n);
}

}  // namespace
}  // namespace fcp
