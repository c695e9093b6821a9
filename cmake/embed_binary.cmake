# cmake -DINPUT=file -DOUTPUT=header -DNAME=symbol -P embed_binary.cmake: a C++ header holding the
# file's bytes (the copy kernel's fatbin, csrc/kernels/copy_batch.cu).
file(READ "${INPUT}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR bytes "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
file(WRITE "${OUTPUT}" "// generated from ${INPUT} by cmake/embed_binary.cmake\n#pragma once\n#include <cstddef>\n"
     "alignas(8) static const unsigned char ${NAME}[] = {${body}};\n"
     "static const size_t ${NAME}_size = ${bytes};\n")
