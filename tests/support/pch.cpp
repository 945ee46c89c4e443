// Host of the test TUs' precompiled header (support/pch.hpp; tests/CMakeLists.txt).
