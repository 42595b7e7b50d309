# cmake -P script: build and install Horovod ${HOROVOD_VERSION} from its PyPI sdist into ${PYTHON}'s
# environment, with C++17 instead of upstream's C++14 and our patches (cmake/patches/*.patch).
# Inputs: PYTHON, HOROVOD_VERSION, WORK_DIR, CHECK_SCRIPT.  Idempotent: returns at once when the installed build already matches.
execute_process(COMMAND ${PYTHON} ${CHECK_SCRIPT} ${HOROVOD_VERSION} RESULT_VARIABLE matches)
if(matches EQUAL 0)
  message(STATUS "Horovod ${HOROVOD_VERSION} already built against this torch: nothing to do")
  return()
endif()

set(src "${WORK_DIR}/horovod-${HOROVOD_VERSION}")
set(sdist "${WORK_DIR}/horovod-${HOROVOD_VERSION}.tar.gz")
file(MAKE_DIRECTORY ${WORK_DIR})
if(NOT EXISTS ${sdist})
  execute_process(COMMAND ${PYTHON} -m pip download --quiet --no-deps --no-binary :all:
                          "horovod==${HOROVOD_VERSION}" -d ${WORK_DIR}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "could not download the horovod==${HOROVOD_VERSION} sdist from PyPI")
  endif()
endif()
file(REMOVE_RECURSE ${src})
file(ARCHIVE_EXTRACT INPUT ${sdist} DESTINATION ${WORK_DIR})

# The two places where upstream pins C++14; torch >= 2.1 headers need C++17.
foreach(cml "${src}/CMakeLists.txt" "${src}/horovod/torch/CMakeLists.txt")
  file(READ ${cml} text)
  string(REPLACE "set(CMAKE_CXX_STANDARD 14)" "set(CMAKE_CXX_STANDARD 17)" patched "${text}")
  if(patched STREQUAL text)
    message(FATAL_ERROR "no 'set(CMAKE_CXX_STANDARD 14)' in ${cml}: has the sdist changed?")
  endif()
  file(WRITE ${cml} "${patched}")
endforeach()

# Our patches to Horovod's sources: cmake/patches/NNNN-short-name.patch, unified diffs against the
# unpacked sdist (-p1), applied in name order.  One that does not apply stops the build, naming it.
# cmake/horovod_matches.py hashes the patch set, so adding or changing a patch triggers a rebuild.
# the patch set's hash as it is now, before applying: stamped after the build (a patch added
# meanwhile must not be stamped as built)
execute_process(COMMAND ${PYTHON} ${CHECK_SCRIPT} ${HOROVOD_VERSION} --patches-sha256
                OUTPUT_VARIABLE patches_sha256 OUTPUT_STRIP_TRAILING_WHITESPACE)
file(GLOB patches "${CMAKE_CURRENT_LIST_DIR}/patches/*.patch")
list(SORT patches)
foreach(p IN LISTS patches)
  get_filename_component(name ${p} NAME)
  execute_process(COMMAND patch -p1 --forward --batch -i ${p}
                  WORKING_DIRECTORY ${src} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "Horovod patch ${name} does not apply to horovod-${HOROVOD_VERSION} "
                        "(has the sdist changed?):\n${out}")
  endif()
  message(STATUS "applied Horovod patch ${name}")
endforeach()

# CPU torch here: no GPU operations unless the caller asks for them (HOROVOD_GPU_OPERATIONS=NCCL).
get_filename_component(venv_bin ${PYTHON} DIRECTORY)
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env
          "PATH=${venv_bin}:$ENV{PATH}"
          HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1
          HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
          CMAKE_BUILD_PARALLEL_LEVEL=2 MAKEFLAGS=-j2
          ${PYTHON} -m pip install -v --no-build-isolation --no-deps ${src}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building Horovod ${HOROVOD_VERSION} failed (see the compiler output above)")
endif()
execute_process(COMMAND ${PYTHON} ${CHECK_SCRIPT} ${HOROVOD_VERSION} --write-stamp ${patches_sha256})
execute_process(COMMAND ${PYTHON} ${CHECK_SCRIPT} ${HOROVOD_VERSION} RESULT_VARIABLE matches)
if(NOT matches EQUAL 0)
  message(FATAL_ERROR "Horovod ${HOROVOD_VERSION} installed but horovod.torch does not load")
endif()
