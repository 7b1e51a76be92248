# Fails when an include runs up the layers: a file of src/<layer>/ (kernels/: ops) that includes a
# header of a layer after its own in LAYERS. Run by the build before any layer compiles
# (CMakeLists.txt); cmake -DSOURCE_DIR=<repo> -DLAYERS=core,config,... [-DSTAMP=<file>] -P <this>.
# An include is looked up as the compiler does: beside the including file first, then under src/
# (or the repository root for kernels/).
cmake_minimum_required(VERSION 3.24)

string(REPLACE "," ";" layers "${LAYERS}")
file(GLOB_RECURSE files RELATIVE ${SOURCE_DIR} ${SOURCE_DIR}/src/*.h ${SOURCE_DIR}/src/*.cpp
     ${SOURCE_DIR}/kernels/*.h ${SOURCE_DIR}/kernels/*.cuh ${SOURCE_DIR}/kernels/*.cu)

# The layer of a path relative to SOURCE_DIR ("" outside the layers, e.g. src/main.cpp).
function(layer_of path out)
  set(layer "")
  if(path MATCHES "^kernels/")
    set(layer ops)
  elseif(path MATCHES "^src/([^/]+)/")
    if(CMAKE_MATCH_1 IN_LIST layers)
      set(layer ${CMAKE_MATCH_1})
    endif()
  endif()
  set(${out} "${layer}" PARENT_SCOPE)
endfunction()

set(errors "")
foreach(file ${files})
  layer_of(${file} own)
  if(own STREQUAL "")
    continue()
  endif()
  list(FIND layers ${own} own_index)
  file(STRINGS ${SOURCE_DIR}/${file} includes REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line ${includes})
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" header "${line}")
    get_filename_component(dir ${SOURCE_DIR}/${file} DIRECTORY)
    if(EXISTS ${dir}/${header})
      file(REAL_PATH ${dir}/${header} found)
      file(RELATIVE_PATH found ${SOURCE_DIR} ${found})
    elseif(header MATCHES "^kernels/")
      set(found ${header})
    else()
      set(found src/${header})
    endif()
    layer_of(${found} target)
    if(target STREQUAL "")
      continue()
    endif()
    list(FIND layers ${target} target_index)
    if(target_index GREATER own_index)
      # The line number, for the message.
      file(READ ${SOURCE_DIR}/${file} text)
      string(FIND "${text}" "${line}" at)
      string(SUBSTRING "${text}" 0 ${at} before)
      string(REGEX MATCHALL "\n" newlines "${before}")
      list(LENGTH newlines n)
      math(EXPR n "${n} + 1")
      string(APPEND errors "  ${file}:${n}: #include \"${header}\": ${own} includes ${target}\n")
    endif()
  endforeach()
endforeach()

if(errors)
  string(REPLACE ";" " " order "${layers}")
  message(FATAL_ERROR "An include runs up the layers of src/ (lowest first: ${order}; kernels/ "
                      "is ops). A layer may include only its own headers and those of the layers "
                      "before it:\n${errors}Move what is needed down to the lower layer, or the "
                      "including code up (docs/contributing.md, Layout).")
endif()
if(STAMP)
  file(TOUCH ${STAMP})
endif()
