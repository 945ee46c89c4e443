// The library's templates for the test executables, instantiated once (see
// include/veloxquant/cache/extern_templates.hpp). Built with the test flags and the checked
// assertions every test TU sees (tests/CMakeLists.txt force-includes support/checked_asserts.hpp).
#define VELOXQUANT_INSTANTIATE_TEMPLATES
#include <veloxquant/cache.hpp>
