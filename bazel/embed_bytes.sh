#!/bin/sh
# embed_bytes.sh FILE SYMBOL: C++ defining trident::internal::SYMBOL (FILE's
# bytes) and SYMBOLSize, for data a binary carries (a proto's descriptor set).
set -e
echo '#include <cstddef>'
echo 'namespace trident::internal {'
echo "extern const unsigned char $2[] = {"
od -An -v -tx1 "$1" | tr -s ' \n' ' ' | sed 's/ \([0-9a-f][0-9a-f]\)/0x\1,/g'
echo '};'
echo "extern const size_t $2Size = sizeof($2);"
echo '}  // namespace trident::internal'
