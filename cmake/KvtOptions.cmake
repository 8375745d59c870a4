# SPDX-License-Identifier: Apache-2.0
# Build options shared by every target.
#   KVT_SANITIZE=address,undefined | thread   sanitizers for everything built
#   KVT_WERROR=ON                             warnings are errors (CI)
#   KVT_FUZZ=ON                               libFuzzer targets (needs clang)
set(KVT_SANITIZE "" CACHE STRING "Sanitizers: address,undefined or thread")
option(KVT_WERROR "Treat warnings as errors" OFF)
option(KVT_FUZZ "Build libFuzzer targets (clang only)" OFF)

add_compile_options(-Wall -Wextra -Wshadow -Wstrict-prototypes
                    -Wmissing-prototypes -Wno-unused-parameter)
add_compile_definitions(_GNU_SOURCE)
if(KVT_WERROR)
  add_compile_options(-Werror)
endif()

if(KVT_SANITIZE)
  if(KVT_SANITIZE MATCHES "thread" AND KVT_SANITIZE MATCHES "address")
    message(FATAL_ERROR "KVT_SANITIZE: thread cannot be combined with address")
  endif()
  add_compile_options(-fsanitize=${KVT_SANITIZE} -fno-omit-frame-pointer
                      -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${KVT_SANITIZE})
endif()

if(KVT_FUZZ AND NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "KVT_FUZZ needs clang (CC=clang)")
endif()
