#include "core/status.h"

#include <cstdarg>
#include <cstdio>

namespace kv {

const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kCacheFull:
      return "cache full";
    case Code::kNotSupported:
      return "not supported";
    case Code::kInvalidArgument:
      return "invalid argument";
    case Code::kOutOfMemory:
      return "out of memory";
    case Code::kCorrupt:
      return "corrupt";
  }
  return "unknown";
}

Status Status::Error(Code code, const char* format, ...) {
  Status s;
  s.code_ = code;
  va_list args;
  va_start(args, format);
  std::vsnprintf(s.message_, sizeof(s.message_), format, args);
  va_end(args);
  return s;
}

}  // namespace kv
