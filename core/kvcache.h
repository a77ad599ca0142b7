// kvcache: the umbrella header. Consumers write #include <kvcache/kvcache.h>.
#ifndef KVCACHE_CORE_KVCACHE_H_
#define KVCACHE_CORE_KVCACHE_H_

#include "core/attend.h"
#include "core/cache.h"
#include "core/mask_index.h"
#include "core/persistence.h"
#include "core/rope_shift.h"
#include "core/sequence_cache.h"
#include "core/status.h"
#include "core/types.h"
#include "layouts/dtype.h"
#include "layouts/tensor_view.h"

#endif  // KVCACHE_CORE_KVCACHE_H_
