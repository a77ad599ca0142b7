// Status: how every fallible call reports. No exceptions, no heap: the message lives inside.
#ifndef KVCACHE_CORE_STATUS_H_
#define KVCACHE_CORE_STATUS_H_

#include <cstdint>

namespace kv {

enum class Code : uint8_t {
  kOk,
  kCacheFull,
  kNotSupported,
  kInvalidArgument,
  kOutOfMemory,
  kCorrupt
};

const char* CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // ok
  static Status Ok() { return Status(); }
  // printf-style message, truncated to fit (kMaxMessage - 1 characters).
  static Status Error(Code code, const char* format, ...) __attribute__((format(printf, 2, 3)));

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const char* message() const { return message_; }  // never null; "" when ok

  static constexpr int kMaxMessage = 120;

 private:
  Code code_ = Code::kOk;
  char message_[kMaxMessage] = {};
};

// Returns the Status of `expr` from the enclosing function when it is an error.
#define KV_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::kv::Status kv_status_ = (expr);        \
    if (!kv_status_.ok()) return kv_status_; \
  } while (0)

}  // namespace kv

#endif  // KVCACHE_CORE_STATUS_H_
