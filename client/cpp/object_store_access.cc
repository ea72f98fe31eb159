#include "client/cpp/object_store_access.h"

#include <cstdlib>
#include <fstream>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

namespace gpufeed::client::internal {
namespace {

// An AWS shared file's sections: name -> key -> value (keys lower-cased, as the SDKs read them).
// A nested block (a key with no value, its lines indented: `s3 =\n  addressing_style = path`)
// is kept under "key.subkey".
using Sections = absl::flat_hash_map<std::string, absl::flat_hash_map<std::string, std::string>>;

// The AWS config/credentials INI form: [section], key = value, comments from # or ; at the
// start of a line. NOT_FOUND when the file does not exist (the next source is tried);
// INVALID_ARGUMENT naming the file and line otherwise.
absl::StatusOr<Sections> ReadSections(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(path);
  // Bounded: a credentials file is small; a huge one is a mistake (or /dev/zero).
  constexpr size_t kMaxBytes = 1 << 20;
  Sections out;
  std::string section, nested, line;
  size_t bytes = 0;
  for (int n = 1; std::getline(in, line); ++n) {
    bytes += line.size() + 1;
    if (bytes > kMaxBytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": larger than 1 MiB"));
    }
    const bool indented = !line.empty() && (line[0] == ' ' || line[0] == '\t');
    absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#' || text[0] == ';') continue;
    if (text.front() == '[') {
      if (text.back() != ']') {
        return absl::InvalidArgumentError(
            absl::StrCat(path, " line ", n, ": a section header without its closing ']'"));
      }
      section = std::string(absl::StripAsciiWhitespace(text.substr(1, text.size() - 2)));
      nested.clear();
      out[section];
      continue;
    }
    const size_t eq = text.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(path, " line ", n, ": no '=' in a key line"));
    }
    if (section.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " line ", n, ": a key before any [section]"));
    }
    std::string key = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text.substr(0, eq)));
    std::string value(absl::StripAsciiWhitespace(text.substr(eq + 1)));
    if (indented && !nested.empty()) {
      out[section][absl::StrCat(nested, ".", key)] = std::move(value);
      continue;
    }
    nested = value.empty() ? key : "";
    out[section][std::move(key)] = std::move(value);
  }
  return out;
}

std::string Home(const EnvLookup& env) {
  const char* home = env("HOME");
  return home != nullptr ? home : "";
}

std::string EnvOr(const EnvLookup& env, const char* name, std::string fallback) {
  const char* v = env(name);
  return v != nullptr && *v != '\0' ? std::string(v) : std::move(fallback);
}

bool Truthy(absl::string_view v) {
  return absl::EqualsIgnoreCase(v, "true") || v == "1" || absl::EqualsIgnoreCase(v, "yes");
}

// The token file's contents (a JWT, a few KiB), trailing whitespace cut.
absl::StatusOr<std::string> ReadToken(const std::string& path, const std::string& from) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(from, ": the web identity token file ", path, " cannot be read"));
  }
  std::ostringstream s;
  s << in.rdbuf();
  std::string token = s.str();
  if (token.size() > (64 << 10)) {
    return absl::InvalidArgumentError(
        absl::StrCat(from, ": the web identity token file ", path, " is larger than 64 KiB"));
  }
  absl::StripTrailingAsciiWhitespace(&token);
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(from, ": the web identity token file ", path, " is empty"));
  }
  return token;
}

}  // namespace

absl::StatusOr<ObjectStoreAccess> ResolveObjectStoreAccess(const EnvLookup& env) {
  ObjectStoreAccess out;
  const std::string profile = EnvOr(env, "AWS_PROFILE", "default");
  const std::string config_path =
      EnvOr(env, "AWS_CONFIG_FILE", absl::StrCat(Home(env), "/.aws/config"));
  const std::string creds_path =
      EnvOr(env, "AWS_SHARED_CREDENTIALS_FILE", absl::StrCat(Home(env), "/.aws/credentials"));
  // The config file's profile: region, endpoint, and credentials of its own.
  absl::flat_hash_map<std::string, std::string> config;
  const std::string config_section =
      profile == "default" ? std::string("default") : absl::StrCat("profile ", profile);
  if (absl::StatusOr<Sections> c = ReadSections(config_path); c.ok()) {
    if (auto it = c->find(config_section); it != c->end()) config = it->second;
  } else if (!absl::IsNotFound(c.status())) {
    return c.status();
  }
  const auto config_value = [&config](const char* key) -> std::string {
    auto it = config.find(key);
    return it == config.end() ? "" : it->second;
  };
  out.region = EnvOr(env, "AWS_REGION", EnvOr(env, "AWS_DEFAULT_REGION", config_value("region")));
  out.endpoint_url = EnvOr(env, "AWS_ENDPOINT_URL_S3",
                           EnvOr(env, "AWS_ENDPOINT_URL", config_value("endpoint_url")));
  if (Truthy(EnvOr(env, "AWS_NO_SIGN_REQUEST", config_value("no_sign_request")))) {
    out.anonymous = true;
    out.source = "anonymous (AWS_NO_SIGN_REQUEST)";
    return out;
  }

  // 1. The environment.
  const char* id = env("AWS_ACCESS_KEY_ID");
  const char* secret = env("AWS_SECRET_ACCESS_KEY");
  if ((id != nullptr && *id != '\0') || (secret != nullptr && *secret != '\0')) {
    if (id == nullptr || *id == '\0' || secret == nullptr || *secret == '\0') {
      return absl::InvalidArgumentError(
          "the environment sets one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY without the "
          "other: set both, or neither");
    }
    out.access_key_id = id;
    out.secret_access_key = secret;
    out.session_token = EnvOr(env, "AWS_SESSION_TOKEN", "");
    out.source = "the environment (AWS_ACCESS_KEY_ID)";
    return out;
  }
  // 2. A web identity named by the environment.
  if (const char* token_file = env("AWS_WEB_IDENTITY_TOKEN_FILE");
      token_file != nullptr && *token_file != '\0') {
    const std::string from = "AWS_WEB_IDENTITY_TOKEN_FILE";
    out.role_arn = EnvOr(env, "AWS_ROLE_ARN", "");
    if (out.role_arn.empty()) {
      return absl::InvalidArgumentError(
          "the environment sets AWS_WEB_IDENTITY_TOKEN_FILE without AWS_ROLE_ARN: set both");
    }
    auto token = ReadToken(token_file, from);
    if (!token.ok()) return token.status();
    out.web_identity_token = *std::move(token);
    out.role_session_name = EnvOr(env, "AWS_ROLE_SESSION_NAME", "gpufeed");
    out.source = absl::StrCat("a web identity (", token_file, ", role ", out.role_arn, ")");
    return out;
  }
  // 3. The shared credentials file, then 4. the config file's profile.
  std::vector<std::string> looked = {
      "the environment (AWS_ACCESS_KEY_ID, "
      "AWS_WEB_IDENTITY_TOKEN_FILE)"};
  absl::flat_hash_map<std::string, std::string> creds;
  if (absl::StatusOr<Sections> c = ReadSections(creds_path); c.ok()) {
    if (auto it = c->find(profile); it != c->end()) creds = it->second;
    looked.push_back(absl::StrCat(creds_path, " [", profile, "]"));
  } else if (absl::IsNotFound(c.status())) {
    looked.push_back(absl::StrCat(creds_path, " (no such file)"));
  } else {
    return c.status();
  }
  for (const auto& [map, where] :
       {std::pair(&creds, absl::StrCat(creds_path, " [", profile, "]")),
        std::pair(&config, absl::StrCat(config_path, " [", config_section, "]"))}) {
    const auto get = [map = map](const char* key) -> std::string {
      auto it = map->find(key);
      return it == map->end() ? "" : it->second;
    };
    const std::string key_id = get("aws_access_key_id"), key = get("aws_secret_access_key");
    if (!key_id.empty() || !key.empty()) {
      if (key_id.empty() || key.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": aws_access_key_id and aws_secret_access_key go together; one is missing"));
      }
      out.access_key_id = key_id;
      out.secret_access_key = key;
      out.session_token = get("aws_session_token");
      out.source = where;
      return out;
    }
    if (const std::string token_file = get("web_identity_token_file"); !token_file.empty()) {
      out.role_arn = get("role_arn");
      if (out.role_arn.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": web_identity_token_file without role_arn"));
      }
      auto token = ReadToken(token_file, where);
      if (!token.ok()) return token.status();
      out.web_identity_token = *std::move(token);
      out.role_session_name =
          get("role_session_name").empty() ? "gpufeed" : get("role_session_name");
      out.source = where;
      return out;
    }
    for (const char* other : {"sso_session", "sso_start_url", "credential_process",
                              "source_profile", "credential_source"}) {
      if (!get(other).empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": credentials by ", other,
            " are not read by gpufeed; export them first (for example `eval \"$(aws configure "
            "export-credentials --format env)\"`) or give a key pair"));
      }
    }
  }
  looked.push_back(absl::StrCat(config_path, " [", config_section, "]"));
  return absl::NotFoundError(
      absl::StrCat("no object store credentials: looked in ", absl::StrJoin(looked, ", "),
                   "; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile (AWS_PROFILE), or "
                   "AWS_NO_SIGN_REQUEST=true for a public bucket"));
}

absl::StatusOr<ObjectStoreAccess> ResolveObjectStoreAccess() {
  return ResolveObjectStoreAccess([](const char* name) { return std::getenv(name); });
}

}  // namespace gpufeed::client::internal
