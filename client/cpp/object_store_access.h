// The caller's access to an object store (s3:// datasets, docs/howto/object-storage.md): the
// client library resolves it where the AWS SDKs and CLI do, in their order, and hands it to
// gpufeedd on the memory socket for one session (the daemon never reads the caller's files or
// environment). Resolved here rather than through an AWS SDK: none is in Debian, and the
// client library must stay small enough to ship inside the wheel.
//
// Credentials, the first source that has them:
//  1. the environment: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN);
//  2. a web identity (Kubernetes IRSA, EKS pod identity's token file): AWS_WEB_IDENTITY_TOKEN_FILE
//     and AWS_ROLE_ARN (+ AWS_ROLE_SESSION_NAME): the token is read here and passed; the daemon
//     exchanges it for credentials (STS AssumeRoleWithWebIdentity, an unsigned call);
//  3. the shared credentials file (AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials),
//     profile AWS_PROFILE (else "default");
//  4. the config file (AWS_CONFIG_FILE, else ~/.aws/config), section [profile NAME] ([default]
//     for default): aws_access_key_id/aws_secret_access_key, or web_identity_token_file with
//     role_arn.
// Region: AWS_REGION, AWS_DEFAULT_REGION, the profile's region, else "" (the daemon signs for
// its own --s3_region whatever the caller's). Endpoint (MinIO,
// Ceph RGW, GCS's XML API): AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's endpoint_url,
// else AWS's own. AWS_NO_SIGN_REQUEST=true (or the profile's no_sign_request): anonymous
// reads of a public bucket. Not read: EC2/ECS instance metadata, SSO and credential_process
// profiles (named in the error when a profile asks for one).
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"

namespace gpufeed::client::internal {

struct ObjectStoreAccess {
  std::string access_key_id;
  std::string secret_access_key;   // never logged, never in a message
  std::string session_token;       // never logged, never in a message
  std::string web_identity_token;  // the token file's contents; never logged
  std::string role_arn;
  std::string role_session_name;
  std::string region;
  std::string endpoint_url;  // "" for AWS's own
  bool anonymous = false;
  // Where the credentials came from, for messages: "the environment (AWS_ACCESS_KEY_ID)",
  // "/home/u/.aws/credentials [profile train]", ...
  std::string source;
};

// An environment variable's value, or nullptr when unset (std::getenv in the library; a map in
// tests).
using EnvLookup = std::function<const char*(const char*)>;

// The caller's access by the order above. NOT_FOUND naming every place looked at when none has
// credentials; INVALID_ARGUMENT naming the file, line and key for a malformed file, an
// incomplete pair (a key id without its secret) or a profile of a kind not read here.
absl::StatusOr<ObjectStoreAccess> ResolveObjectStoreAccess(const EnvLookup& env);

// ResolveObjectStoreAccess(std::getenv).
absl::StatusOr<ObjectStoreAccess> ResolveObjectStoreAccess();

}  // namespace gpufeed::client::internal
