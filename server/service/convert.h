// Proto <-> core conversion for the Feed and Admin services: the only place, with the
// service adapters, that sees generated code. Conversion refuses what the core's types cannot
// hold (an enum value out of range, a pipeline op with none set); every rule about the values
// is the core's (server/session/attach_spec.h).
#pragma once

#include "absl/status/statusor.h"
#include "gpufeed/v1/feed.pb.h"
#include "grpcpp/support/status.h"
#include "server/augment/pipeline.h"
#include "server/session/session_manager.h"

namespace gpufeed::server {

absl::StatusOr<AttachSpec> AttachSpecFromProto(const v1::AttachRequest& request);
// The ops of an image pipeline; INVALID_ARGUMENT naming the op for an empty or unknown one.
absl::StatusOr<std::vector<PipelineStep>> PipelineFromProto(
    const google::protobuf::RepeatedPtrField<v1::PipelineOp>& ops);
void ToProto(const Attachment& attachment, v1::AttachResponse* response);
void ToProto(const ReadyBatch& batch, v1::BatchReady* out);
void ToProto(const SessionSnapshot& session, v1::SessionInfo* out);
void ToProto(const FeedSnapshot& feed, v1::FeedInfo* out);
// `samples`: the global cursor at `position` (Sampler::Cursor).
void ToProto(const Position& position, uint64_t samples, v1::Position* out);

grpc::Status ToGrpcStatus(const absl::Status& status);

// The memory socket's object_store (a caller's access, never logged).
objstore::ObjectStoreAccess ToObjectStoreAccess(const v1::ObjectStoreAccess& access);

}  // namespace gpufeed::server
