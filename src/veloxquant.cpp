// The compiled form of veloxquant (target veloxquant::compiled): the caches for half, bfloat16 and
// float instantiated once, so consumer TUs that define VELOXQUANT_EXTERN_TEMPLATES skip them.
#define VELOXQUANT_INSTANTIATE_TEMPLATES
#include <veloxquant/cache.hpp>
