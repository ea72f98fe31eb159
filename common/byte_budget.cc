#include "common/byte_budget.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace gpufeed {

ByteBudget::Charge::~Charge() { budget_->Return(uid_, bytes_); }

absl::Status ByteBudget::Charge::Grow(uint64_t more, absl::string_view what) {
  if (more == 0) return absl::OkStatus();
  absl::Status s = budget_->Add(uid_, more, what);
  if (s.ok()) bytes_ += more;
  return s;
}

std::shared_ptr<ByteBudget> ByteBudget::Create(std::string name, uint64_t capacity,
                                               std::string per_uid_name, uint64_t per_uid,
                                               std::string advice) {
  return std::shared_ptr<ByteBudget>(new ByteBudget(
      std::move(name), capacity, std::move(per_uid_name), per_uid, std::move(advice)));
}

ByteBudget::ByteBudget(std::string name, uint64_t capacity, std::string per_uid_name,
                       uint64_t per_uid, std::string advice)
    : name_(std::move(name)),
      capacity_(capacity),
      per_uid_name_(std::move(per_uid_name)),
      per_uid_(per_uid != 0 ? per_uid : capacity / 2),
      advice_(std::move(advice)) {}

absl::StatusOr<std::unique_ptr<ByteBudget::Charge>> ByteBudget::Take(std::optional<uint32_t> uid,
                                                                     uint64_t bytes,
                                                                     absl::string_view what) {
  absl::Status s = Add(uid, bytes, what);
  if (!s.ok()) return s;
  return std::unique_ptr<Charge>(new Charge(shared_from_this(), uid, bytes));
}

absl::Status ByteBudget::Add(std::optional<uint32_t> uid, uint64_t bytes, absl::string_view what) {
  absl::MutexLock lock(&mu_);
  if (bytes > capacity_ - used_) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " need ", bytes, " bytes; ", used_,
                                                     " of ", name_, " ", capacity_,
                                                     " are in use: ", advice_));
  }
  if (uid.has_value()) {
    const uint64_t mine = by_uid_.contains(*uid) ? by_uid_[*uid] : 0;
    if (bytes > per_uid_ - std::min(mine, per_uid_)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " need ", bytes, " bytes; uid ", *uid, " holds ", mine, " of its share of ", name_,
          " (", per_uid_name_, " ", per_uid_, "): ", advice_));
    }
    by_uid_[*uid] = mine + bytes;
  }
  used_ += bytes;
  return absl::OkStatus();
}

void ByteBudget::Return(std::optional<uint32_t> uid, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  used_ -= bytes;
  if (uid.has_value()) {
    auto it = by_uid_.find(*uid);
    if (it != by_uid_.end() && (it->second -= bytes) == 0) by_uid_.erase(it);
  }
}

uint64_t ByteBudget::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

uint64_t ByteBudget::used_by(uint32_t uid) const {
  absl::MutexLock lock(&mu_);
  auto it = by_uid_.find(uid);
  return it == by_uid_.end() ? 0 : it->second;
}

}  // namespace gpufeed
