#include "fusedmlp/fusedmlp.h"

const char *fmlp_status_string(fmlp_status status) {
  switch (status) {
    case FMLP_OK: return "ok";
    case FMLP_ERR_INVALID_ARGUMENT: return "invalid argument";
    case FMLP_ERR_SIZE_OVERFLOW: return "sizes overflow 64-bit arithmetic";
    case FMLP_ERR_OUT_OF_MEMORY: return "out of memory";
    case FMLP_ERR_UNSUPPORTED: return "unsupported dtype or configuration";
    case FMLP_ERR_BACKEND: return "backend library error";
  }
  return "unknown status";
}
