// ResolveObjectStoreAccess: the AWS SDKs' order of sources (environment, web identity, the
// shared credentials file, the config file), region and endpoint, and errors that name the
// file, line or variable and never a secret.
#include "client/cpp/object_store_access.h"

#include <sys/stat.h>

#include <map>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace gpufeed::client::internal {
namespace {

using ::gpufeed::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;

class Env {
 public:
  explicit Env(const TempDir& home) {
    vars_["HOME"] = home.path();
    ::mkdir(home.Join(".aws").c_str(), 0700);
  }
  Env& Set(const std::string& k, const std::string& v) {
    vars_[k] = v;
    return *this;
  }
  EnvLookup lookup() const {
    return [this](const char* name) -> const char* {
      auto it = vars_.find(name);
      return it == vars_.end() ? nullptr : it->second.c_str();
    };
  }

 private:
  std::map<std::string, std::string> vars_;
};

TEST(ObjectStoreAccessTest, TheEnvironmentComesFirst) {
  TempDir home;
  Env env(home);
  home.WriteFile(".aws/credentials",
                 "[default]\naws_access_key_id = FILEKEY\n"
                 "aws_secret_access_key = filesecret\n");
  env.Set("AWS_ACCESS_KEY_ID", "ENVKEY")
      .Set("AWS_SECRET_ACCESS_KEY", "envsecret")
      .Set("AWS_SESSION_TOKEN", "envtoken")
      .Set("AWS_DEFAULT_REGION", "eu-west-1");
  absl::StatusOr<ObjectStoreAccess> a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->access_key_id, "ENVKEY");
  EXPECT_EQ(a->secret_access_key, "envsecret");
  EXPECT_EQ(a->session_token, "envtoken");
  EXPECT_EQ(a->region, "eu-west-1");
  EXPECT_EQ(a->endpoint_url, "");
  EXPECT_EQ(a->source, "the environment (AWS_ACCESS_KEY_ID)");

  env.Set("AWS_SECRET_ACCESS_KEY", "");
  a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"));
}

TEST(ObjectStoreAccessTest, AProfileOfTheFilesWithItsRegionAndEndpoint) {
  TempDir home;
  Env env(home);
  home.WriteFile(
      ".aws/credentials",
      "# a comment\n[default]\naws_access_key_id = DEF\naws_secret_access_key = d\n\n"
      "[train]\n  aws_access_key_id=TRAINKEY  \n; another\naws_secret_access_key = t/s+k\n"
      "aws_session_token = tok\n");
  home.WriteFile(".aws/config",
                 "[default]\nregion = us-west-2\n[profile train]\nregion = "
                 "eu-central-1\nendpoint_url = http://minio:9000\ns3 =\n"
                 "  addressing_style = path\n");
  env.Set("AWS_PROFILE", "train");
  absl::StatusOr<ObjectStoreAccess> a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->access_key_id, "TRAINKEY");
  EXPECT_EQ(a->secret_access_key, "t/s+k");
  EXPECT_EQ(a->session_token, "tok");
  EXPECT_EQ(a->region, "eu-central-1");
  EXPECT_EQ(a->endpoint_url, "http://minio:9000");
  EXPECT_EQ(a->source, home.Join(".aws/credentials") + " [train]");
  // The environment's endpoint and region win over the profile's; the S3 one over the general.
  env.Set("AWS_ENDPOINT_URL", "http://a:1")
      .Set("AWS_ENDPOINT_URL_S3", "http://s3:2")
      .Set("AWS_REGION", "ap-south-1");
  a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->endpoint_url, "http://s3:2");
  EXPECT_EQ(a->region, "ap-south-1");
  // The default profile, and no region where nothing names one.
  Env plain(home);
  plain.Set("AWS_CONFIG_FILE", home.Join("none"));
  a = ResolveObjectStoreAccess(plain.lookup());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->access_key_id, "DEF");
  EXPECT_EQ(a->region, "");
}

TEST(ObjectStoreAccessTest, CredentialsInTheConfigFileAndWebIdentities) {
  TempDir home;
  Env env(home);
  home.WriteFile(".aws/config",
                 "[profile c]\naws_access_key_id = CFG\naws_secret_access_key = c\n"
                 "[profile w]\nweb_identity_token_file = " +
                     home.Join("token") + "\nrole_arn = arn:aws:iam::1:role/r\n");
  home.WriteFile("token", "eyJ.jwt.sig\n");
  env.Set("AWS_PROFILE", "c");
  absl::StatusOr<ObjectStoreAccess> a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->access_key_id, "CFG");
  EXPECT_EQ(a->source, home.Join(".aws/config") + " [profile c]");
  env.Set("AWS_PROFILE", "w");
  a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->web_identity_token, "eyJ.jwt.sig");
  EXPECT_EQ(a->role_arn, "arn:aws:iam::1:role/r");
  EXPECT_EQ(a->role_session_name, "gpufeed");
  EXPECT_TRUE(a->access_key_id.empty());
  // From the environment (Kubernetes IRSA), before any file.
  Env irsa(home);
  irsa.Set("AWS_WEB_IDENTITY_TOKEN_FILE", home.Join("token"))
      .Set("AWS_ROLE_ARN", "arn:aws:iam::2:role/x")
      .Set("AWS_ROLE_SESSION_NAME", "job7");
  a = ResolveObjectStoreAccess(irsa.lookup());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->role_arn, "arn:aws:iam::2:role/x");
  EXPECT_EQ(a->role_session_name, "job7");
  irsa.Set("AWS_ROLE_ARN", "");
  a = ResolveObjectStoreAccess(irsa.lookup());
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr("without AWS_ROLE_ARN"));
  irsa.Set("AWS_ROLE_ARN", "arn:x").Set("AWS_WEB_IDENTITY_TOKEN_FILE", home.Join("missing"));
  a = ResolveObjectStoreAccess(irsa.lookup());
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr(home.Join("missing") + " cannot be read"));
}

TEST(ObjectStoreAccessTest, RefusalsNameTheFileAndNeverASecret) {
  TempDir home;
  Env env(home);
  absl::StatusOr<ObjectStoreAccess> a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(a.status().message(), HasSubstr(home.Join(".aws/credentials") + " (no such file)"));
  EXPECT_THAT(a.status().message(), HasSubstr("AWS_NO_SIGN_REQUEST=true"));

  home.WriteFile(".aws/credentials", "[default]\naws_secret_access_key = SUPERSECRET\n");
  a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr("one is missing"));
  EXPECT_THAT(a.status().message(), Not(HasSubstr("SUPERSECRET")));

  home.WriteFile(".aws/credentials", "[default]\naws_access_key_id SUPERSECRET\n");
  a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr(home.Join(".aws/credentials") + " line 2: no '='"));
  EXPECT_THAT(a.status().message(), Not(HasSubstr("SUPERSECRET")));

  home.WriteFile(".aws/credentials", "[default]\ncredential_process = /bin/get-creds\n");
  a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_FALSE(a.ok());
  EXPECT_THAT(a.status().message(), HasSubstr("credentials by credential_process"));

  env.Set("AWS_NO_SIGN_REQUEST", "true");
  a = ResolveObjectStoreAccess(env.lookup());
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->anonymous);
}

}  // namespace
}  // namespace gpufeed::client::internal
