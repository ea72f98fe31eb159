#!/usr/bin/env python3
"""A real S3 server on loopback for tests: moto's server mode, with its signature checks on.

The test that starts it (tests/unit/server/objstore/s3_test_server.h) reads one JSON line from
stdout once the server listens:

    {"port": 41234, "access_key": "AKIA...", "secret": "..."}

Signatures are checked (moto's INITIAL_NO_AUTH_ACTION_COUNT): the first requests, which create
an IAM user with an access key and an allow-all policy, go unauthenticated; every later one,
ours and the client's under test alike, must be signed with that key, so a wrong secret or a
canonicalization bug fails as it would against AWS.

The test then drives it with one JSON command a line on stdin; each is answered with one line,
"ok", "ok {JSON}" or "error: ...":

    {"op": "create_bucket", "bucket": "b"}
    {"op": "put", "bucket": "b", "key": "k", "file": "/tmp/x"}      the file's bytes
    {"op": "put", "bucket": "b", "key": "k", "text": "..."}         the UTF-8 text
    {"op": "put_many", "bucket": "b", "objects": [{"key": "k", "text": "..."}, ...]}
    {"op": "delete", "bucket": "b", "key": "k"}
    {"op": "temporary_credentials"}   ok {"access_key": ..., "secret": ..., "token": ...}:
                                      STS AssumeRole of an allow-all role, for session tokens

--no_auth: no signature checks at all. moto checks a signature on STS's
AssumeRoleWithWebIdentity too, which AWS takes unsigned; so that call is tested there.

It exits when stdin closes (the test's process ended, whatever the way).

    python3 tests/testing/moto_s3_server.py [--no_auth]
"""

import json
import os
import sys

# The requests before signatures are checked: CreateUser, CreateAccessKey, PutUserPolicy below.
# moto reads it when it is imported.
UNAUTHENTICATED_SETUP_REQUESTS = 3
if "--no_auth" not in sys.argv[1:]:
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = str(UNAUTHENTICATED_SETUP_REQUESTS)

import boto3  # noqa: E402  (after the environment moto reads)
from botocore.config import Config  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

ALLOW_ALL = json.dumps({
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
})


def main() -> int:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    endpoint = f"http://127.0.0.1:{port}"
    # Any key passes the unauthenticated setup requests.
    iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1",
                       aws_access_key_id="setup", aws_secret_access_key="setup")
    iam.create_user(UserName="gpufeed-test")
    key = iam.create_access_key(UserName="gpufeed-test")["AccessKey"]
    iam.put_user_policy(UserName="gpufeed-test", PolicyName="all", PolicyDocument=ALLOW_ALL)
    session = boto3.session.Session(aws_access_key_id=key["AccessKeyId"],
                                    aws_secret_access_key=key["SecretAccessKey"],
                                    region_name="us-east-1")
    config = Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1})
    # IAM's and STS's clients only when a test asks for temporary credentials: each costs
    # ~0.1 s to make.
    clients = {"s3": session.client("s3", endpoint_url=endpoint, config=config),
               "new": lambda name: session.client(name, endpoint_url=endpoint, config=config)}
    print(json.dumps({"port": port, "access_key": key["AccessKeyId"],
                      "secret": key["SecretAccessKey"]}), flush=True)

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            command = json.loads(line)
            answer = run(clients, command)
            print("ok" if answer is None else f"ok {json.dumps(answer)}", flush=True)
        except Exception as e:  # noqa: BLE001  (every failure is the test's to report)
            print(f"error: {type(e).__name__}: {e}".replace("\n", " "), flush=True)
    server.stop()
    return 0


def run(clients: dict, command: dict):
    s3 = clients["s3"]
    op = command["op"]
    if op == "create_bucket":
        s3.create_bucket(Bucket=command["bucket"])
    elif op == "put":
        if "file" in command:
            with open(command["file"], "rb") as f:
                body = f.read()
        else:
            body = command["text"].encode()
        s3.put_object(Bucket=command["bucket"], Key=command["key"], Body=body)
    elif op == "put_many":
        for item in command["objects"]:
            s3.put_object(Bucket=command["bucket"], Key=item["key"], Body=item["text"].encode())
    elif op == "delete":
        s3.delete_object(Bucket=command["bucket"], Key=command["key"])
    elif op == "temporary_credentials":
        iam = clients["new"]("iam")
        trust = json.dumps({"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "sts:AssumeRole"}]})
        try:
            role = iam.get_role(RoleName="gpufeed-reader")["Role"]
        except iam.exceptions.NoSuchEntityException:
            role = iam.create_role(RoleName="gpufeed-reader",
                                   AssumeRolePolicyDocument=trust)["Role"]
            iam.put_role_policy(RoleName="gpufeed-reader", PolicyName="all",
                                PolicyDocument=ALLOW_ALL)
        c = clients["new"]("sts").assume_role(RoleArn=role["Arn"],
                                       RoleSessionName="test")["Credentials"]
        return {"access_key": c["AccessKeyId"], "secret": c["SecretAccessKey"],
                "token": c["SessionToken"]}
    else:
        raise ValueError(f"unknown op {op!r}")
    return None


if __name__ == "__main__":
    sys.exit(main())
