# Installs the built library into a scratch prefix, then configures, builds and runs a tiny consumer
# project that uses it exactly as an external runtime would.
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed: ${rc}")
endif()
# The consumer is built like the library: same compilers, and when cross-compiling the same
# toolchain file, with its programs run through the same emulator (the `aarch64` preset).
set(consumer_args -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_CXX_COMPILER=${CXX})
if(CC)
  list(APPEND consumer_args -DCMAKE_C_COMPILER=${CC})
endif()
if(TOOLCHAIN_FILE)
  list(APPEND consumer_args -DCMAKE_TOOLCHAIN_FILE=${TOOLCHAIN_FILE})
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer -B ${WORK_DIR}/build
                        ${consumer_args}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer configure failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer build failed: ${rc}")
endif()
execute_process(COMMAND ${EMULATOR} ${WORK_DIR}/build/consumer RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "consumer said: ${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer run failed: ${rc}")
endif()
execute_process(COMMAND ${EMULATOR} ${WORK_DIR}/build/consumer_c RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "C consumer said: ${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "C consumer run failed: ${rc}")
endif()
