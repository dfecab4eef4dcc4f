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

// A recv whose matching send has another element count or dtype: the message was
// discarded and the pair (and group) stay usable.
struct MessageMismatch : CollectiveError {
  using CollectiveError::CollectiveError;
};

// A collective that could not finish within the timeout, or a peer that died.
struct CollectiveTimeout : CollectiveError {
  using CollectiveError::CollectiveError;
};

}  // namespace pz
