// The XML and URL pieces of the S3 client, on documents written as S3 writes them.
#include "server/objstore/s3_xml.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/objstore/s3_config.h"
#include "server/objstore/s3_uri.h"

namespace gpufeed::objstore {
namespace {

using ::testing::HasSubstr;

TEST(DecodeXmlTextTest, DecodesEntitiesAndCharacterReferences) {
  EXPECT_EQ(*DecodeXmlText("a &amp; b &lt;c&gt; &quot;q&quot; &apos;s&apos;"),
            "a & b <c> \"q\" 's'");
  EXPECT_EQ(*DecodeXmlText("cr&#13;lf&#x0A;e&#xE9;&#26085;"), "cr\rlf\ne\xC3\xA9\xE6\x97\xA5");
  EXPECT_EQ(*DecodeXmlText("&#x1F600;"), "\xF0\x9F\x98\x80");
  EXPECT_EQ(*DecodeXmlText(""), "");
}

TEST(DecodeXmlTextTest, RefusesBadReferences) {
  EXPECT_EQ(DecodeXmlText("a & b").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeXmlText("&nbsp;").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeXmlText("&#xD800;").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeXmlText("&#x110000;").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeXmlText("&#;").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(XmlElementsTest, MatchesWholeNamesOnly) {
  const char* xml = "<R><KeyCount>2</KeyCount><Key>a</Key><Key attr=\"1\">b</Key><Key/></R>";
  EXPECT_THAT(XmlElements(xml, "Key"), ::testing::ElementsAre("a", "b", ""));
  EXPECT_THAT(XmlElements(xml, "KeyCount"), ::testing::ElementsAre("2"));
  EXPECT_TRUE(XmlElements(xml, "Missing").empty());
}

TEST(ParseS3ErrorTest, ReadsCodeAndMessage) {
  const S3ErrorBody e = ParseS3Error(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>NoSuchKey</Code>"
      "<Message>The specified key does not exist.</Message><Key>a&amp;b</Key></Error>");
  EXPECT_EQ(e.code, "NoSuchKey");
  EXPECT_EQ(e.message, "The specified key does not exist.");
  EXPECT_EQ(ParseS3Error("<html>bad gateway</html>").code, "");
  // STS wraps its error one level deeper.
  EXPECT_EQ(ParseS3Error("<ErrorResponse><Error><Code>AccessDenied</Code></Error>"
                         "</ErrorResponse>").code,
            "AccessDenied");
}

TEST(ParseListObjectsV2Test, ReadsEntriesAndTheContinuationToken) {
  const char* xml =
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>b</Name>"
      "<Prefix>p/</Prefix><KeyCount>2</KeyCount><MaxKeys>2</MaxKeys><IsTruncated>true</IsTruncated>"
      "<NextContinuationToken>1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=</NextContinuationToken>"
      "<Contents><Key>p/a&amp;b</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
      "<ETag>&quot;0cc175b9c0f1b6a831c399e269772661&quot;</ETag><Size>1</Size>"
      "<StorageClass>STANDARD</StorageClass></Contents>"
      "<Contents><Key>p/big</Key><ETag>\"abc-2\"</ETag><Size>10737418240</Size></Contents>"
      "</ListBucketResult>";
  absl::StatusOr<S3ListPage> page = ParseListObjectsV2(xml);
  ASSERT_TRUE(page.ok()) << page.status();
  ASSERT_EQ(page->entries.size(), 2u);
  EXPECT_EQ(page->entries[0].key, "p/a&b");
  EXPECT_EQ(page->entries[0].etag, "\"0cc175b9c0f1b6a831c399e269772661\"");
  EXPECT_EQ(page->entries[0].size, 1u);
  EXPECT_EQ(page->entries[1].size, 10737418240u);
  EXPECT_TRUE(page->truncated);
  EXPECT_EQ(page->next_continuation_token, "1ueGcxLPRx1Tr/XYExHnhbYLgveDs2J/wm36Hy4vbOwM=");
}

TEST(ParseListObjectsV2Test, DecodesUrlEncodedKeysOnlyWhenTheStoreSaysSo) {
  const char* encoded =
      "<ListBucketResult><EncodingType>url</EncodingType><IsTruncated>false</IsTruncated>"
      "<Contents><Key>a+b%2Bc%3D%C3%A9%0D</Key><Size>3</Size></Contents></ListBucketResult>";
  absl::StatusOr<S3ListPage> page = ParseListObjectsV2(encoded);
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(page->entries[0].key, "a b+c=\xC3\xA9\r");
  EXPECT_FALSE(page->truncated);
  // A store that ignored encoding-type sends the key as it is: a "+" stays a "+".
  const char* raw =
      "<ListBucketResult><IsTruncated>false</IsTruncated>"
      "<Contents><Key>a+b%2B</Key><Size>3</Size></Contents></ListBucketResult>";
  page = ParseListObjectsV2(raw);
  ASSERT_TRUE(page.ok()) << page.status();
  EXPECT_EQ(page->entries[0].key, "a+b%2B");
}

TEST(ParseListObjectsV2Test, RefusesWhatIsNoPage) {
  EXPECT_THAT(ParseListObjectsV2("<Error/>").status().message(), HasSubstr("ListBucketResult"));
  EXPECT_THAT(ParseListObjectsV2("<ListBucketResult><IsTruncated>false</IsTruncated>"
                                 "<Contents><Key>k</Key><Size>-1</Size></Contents>"
                                 "</ListBucketResult>")
                  .status()
                  .message(),
              HasSubstr("<Size>"));
  EXPECT_THAT(ParseListObjectsV2("<ListBucketResult><IsTruncated>true</IsTruncated>"
                                 "</ListBucketResult>")
                  .status()
                  .message(),
              HasSubstr("NextContinuationToken"));
}

TEST(ParseStsCredentialsTest, ReadsTheCredentials) {
  absl::StatusOr<StsCredentials> c = ParseStsCredentials(
      "<AssumeRoleWithWebIdentityResponse><AssumeRoleWithWebIdentityResult><Credentials>"
      "<SessionToken>tok&amp;en</SessionToken><SecretAccessKey>sec/ret+</SecretAccessKey>"
      "<Expiration>2026-12-07T06:00:00Z</Expiration><AccessKeyId>ASIAEXAMPLE</AccessKeyId>"
      "</Credentials></AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->access_key_id, "ASIAEXAMPLE");
  EXPECT_EQ(c->secret_access_key, "sec/ret+");
  EXPECT_EQ(c->session_token, "tok&en");
  EXPECT_EQ(c->expiration, "2026-12-07T06:00:00Z");
}

TEST(UriTest, EncodesAsSigV4Wants) {
  EXPECT_EQ(UriEncode("dir/a b+c=d~e.f_g-h", true), "dir/a%20b%2Bc%3Dd~e.f_g-h");
  EXPECT_EQ(UriEncode("dir/a", false), "dir%2Fa");
  EXPECT_EQ(UriEncode("\xC3\xA9", true), "%C3%A9");
  EXPECT_EQ(*UrlDecode("a+b%2b%C3%A9"), "a b+\xC3\xA9");
  EXPECT_FALSE(UrlDecode("a%2").ok());
  EXPECT_FALSE(UrlDecode("a%zz").ok());
  EXPECT_EQ(CanonicalQuery({{"prefix", "a b/c"}, {"list-type", "2"}, {"continuation-token", "x=+"}}),
            "continuation-token=x%3D%2B&list-type=2&prefix=a%20b%2Fc");
  EXPECT_EQ(S3Url("b", "k\n"), "s3://b/k\\n");
}

TEST(S3ConfigTest, NamesTheBadField) {
  EXPECT_TRUE(ValidateS3Config(S3Config{}).ok());
  S3Config c;
  c.endpoint = "ftp://host";
  EXPECT_THAT(ValidateS3Config(c).message(), HasSubstr("s3.endpoint"));
  c.endpoint = "http://host:9000/path";
  EXPECT_THAT(ValidateS3Config(c).message(), HasSubstr("no path"));
  c.endpoint = "http://host:9000/";
  EXPECT_TRUE(ValidateS3Config(c).ok());
  c.region = "us east";
  EXPECT_THAT(ValidateS3Config(c).message(), HasSubstr("s3.region"));
  c.region = "auto";
  c.max_attempts = 0;
  EXPECT_THAT(ValidateS3Config(c).message(), HasSubstr("s3.max_attempts"));
  c.max_attempts = 3;
  c.max_connections = 0;
  EXPECT_THAT(ValidateS3Config(c).message(), HasSubstr("s3.max_connections"));
  c.max_connections = 4;
  c.backoff_max = absl::ZeroDuration();
  EXPECT_THAT(ValidateS3Config(c).message(), HasSubstr("s3.backoff"));
}

TEST(S3CredentialsTest, DebugStringRedactsTheSecrets) {
  S3Credentials c{"AKIAEXAMPLE", "wJalrXUtnFEMI/K7MDENG", "FwoGZXIvYXdzEJr"};
  const std::string s = c.DebugString();
  EXPECT_THAT(s, HasSubstr("AKIAEXAMPLE"));
  EXPECT_THAT(s, ::testing::Not(HasSubstr("wJalrXUtnFEMI")));
  EXPECT_THAT(s, ::testing::Not(HasSubstr("FwoGZXIvYXdzEJr")));
  EXPECT_THAT(S3Credentials{}.DebugString(), HasSubstr("anonymous"));
}

}  // namespace
}  // namespace gpufeed::objstore
