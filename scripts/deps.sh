#!/usr/bin/env bash
# Installs what the build needs when it is missing (Debian/Ubuntu, run as root or with sudo).
set -euo pipefail
need=()
[ -f /usr/include/eigen3/Eigen/Core ] || need+=(libeigen3-dev)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v g++ >/dev/null 2>&1 || need+=(g++)
if [ "${1:-}" != "--demo-only" ]; then
  [ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
  [ -f /usr/include/benchmark/benchmark.h ] || need+=(libbenchmark-dev)
  # The Python module's test (tests/python): Debian's interpreter and numpy, no pip.
  /usr/bin/python3 -c "import numpy" >/dev/null 2>&1 || need+=(python3-numpy)
  command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
fi
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "[deps] installing: ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
