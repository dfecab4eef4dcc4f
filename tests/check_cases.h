// check_cases.h — the case count of the C++ test programs tests/*_on_cpu.cpp: each check()
// counts a case and prints a failing one; report() prints the line their Python tests read
// ("N cases, M failures") and gives the exit code.
#pragma once

#include <cstdio>
#include <string>

namespace check_cases {

inline int failures = 0, cases = 0;

inline void check(bool ok, const std::string& what) {
  ++cases;
  if (!ok) {
    ++failures;
    std::printf("FAIL: %s\n", what.c_str());
  }
}

inline int report() {
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}

}  // namespace check_cases
