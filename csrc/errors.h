// errors.h — exception types shared by every transport. Library code throws,
// never exits: bindings.cpp maps these to pyzero.CollectiveError /
// pyzero.CollectiveTimeout on the rank that hit them.
#pragma once

#include <stdexcept>
#include <string>

namespace pz {

// A collective that cannot complete correctly (mismatched calls, a transport
// failure, a group aborted by an earlier failure).
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A collective that could not finish within the timeout, or a peer that died.
struct CollectiveTimeout : CollectiveError {
  using CollectiveError::CollectiveError;
};

}  // namespace pz
