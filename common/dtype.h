// The element types are part of the public client API; the daemon uses the same enum.
#pragma once

#include "gpufeed/dtype.h"
