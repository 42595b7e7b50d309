# cmake -P script: build and install Horovod ${HOROVOD_VERSION} from its PyPI sdist into ${PYTHON}'s
# environment, with C++17 instead of upstream's C++14 and our patches (cmake/patches/*.patch).
# Inputs: PYTHON, HOROVOD_VERSION, WORK_DIR, CHECK_SCRIPT.  Idempotent: returns at once when the installed build already matches.
# With NCCL for GPU operations where cmake/detect_gpu.py finds nvcc, NCCL and a CUDA torch.
# GPU operations: NCCL where nvcc, NCCL and a CUDA torch are found (cmake/detect_gpu.py), else
# CPU only.  The choice is taken once here and handed to every check and to the stamp, so a
# build is stamped with what it built.
execute_process(COMMAND ${PYTHON} ${CMAKE_CURRENT_LIST_DIR}/detect_gpu.py --choice
                OUTPUT_VARIABLE gpu_choice OUTPUT_STRIP_TRAILING_WHITESPACE
                ERROR_VARIABLE gpu_line ERROR_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT gpu_choice MATCHES "^(NCCL|none)$")
  message(FATAL_ERROR "cmake/detect_gpu.py --choice failed: '${gpu_choice}' ${gpu_line}")
endif()
message(STATUS "${gpu_line}")
execute_process(COMMAND ${PYTHON} ${CHECK_SCRIPT} ${HOROVOD_VERSION} --gpu ${gpu_choice}
                RESULT_VARIABLE matches)
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
execute_process(COMMAND ${PYTHON} ${CHECK_SCRIPT} ${HOROVOD_VERSION} --gpu ${gpu_choice}
                        --patches-sha256
                OUTPUT_VARIABLE patches_sha256 OUTPUT_STRIP_TRAILING_WHITESPACE)
file(GLOB patches "${CMAKE_CURRENT_LIST_DIR}/patches/*.patch")
list(SORT patches)
# NCCL builds also get cmake/patches/nccl/*.patch, after the others (they touch GPU code only).
# (Horovod's CUDA kernels stay C++11: cuda_kernels.cu compiles so with nvcc 13.0 for sm_90.)
if(gpu_choice STREQUAL "NCCL")
  file(GLOB nccl_patches "${CMAKE_CURRENT_LIST_DIR}/patches/nccl/*.patch")
  list(SORT nccl_patches)
  list(APPEND patches ${nccl_patches})
endif()
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

# NCCL builds: HOROVOD_GPU_OPERATIONS=NCCL, HOROVOD_CUDA_HOME, HOROVOD_NCCL_INCLUDE/LIB/LINK,
# CUDA_HOME (detect_gpu.py --cmake-env, KEY=VALUE;...); CPU-only builds: nothing.
set(gpu_env "")
if(gpu_choice STREQUAL "NCCL")
  execute_process(COMMAND ${PYTHON} ${CMAKE_CURRENT_LIST_DIR}/detect_gpu.py --cmake-env
                          --link-dir ${WORK_DIR}/nccl-lib
                  OUTPUT_VARIABLE gpu_env OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR gpu_env STREQUAL "")
    message(FATAL_ERROR "cmake/detect_gpu.py --cmake-env failed")
  endif()
  message(STATUS "GPU build environment: ${gpu_env}")
endif()
get_filename_component(venv_bin ${PYTHON} DIRECTORY)
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env
          "PATH=${venv_bin}:$ENV{PATH}"
          ${gpu_env}
          HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1
          HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
          CMAKE_BUILD_PARALLEL_LEVEL=2 MAKEFLAGS=-j2
          ${PYTHON} -m pip install -v --no-build-isolation --no-deps ${src}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building Horovod ${HOROVOD_VERSION} failed (see the compiler output above)")
endif()
execute_process(COMMAND ${PYTHON} ${CHECK_SCRIPT} ${HOROVOD_VERSION} --gpu ${gpu_choice}
                        --write-stamp ${patches_sha256})
execute_process(COMMAND ${PYTHON} ${CHECK_SCRIPT} ${HOROVOD_VERSION} --gpu ${gpu_choice}
                RESULT_VARIABLE matches)
if(NOT matches EQUAL 0)
  message(FATAL_ERROR "Horovod ${HOROVOD_VERSION} installed but horovod.torch does not load "
                      "(or lacks NCCL although GPU operations were asked for: ${gpu_choice})")
endif()
