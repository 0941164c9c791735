// Text-format protobuf files (configs, strategies, LoRA configs), read with
// errors that name the file, the first bad line and the .proto with the fields.
#ifndef TRIDENT_BASE_TEXT_PROTO_H_
#define TRIDENT_BASE_TEXT_PROTO_H_

#include <string>

#include "absl/status/status.h"

namespace google::protobuf {
class FieldDescriptor;
class Message;
}  // namespace google::protobuf

namespace trident {

// Fills `message` from the text file `path`. Errors: NotFound "cannot read
// <what> file <path>"; InvalidArgument "<what> file <path> is not a valid
// <Message> (line L column C: ...); the fields are in <its .proto>".
absl::Status ReadTextProto(const std::string& path, const std::string& what, google::protobuf::Message* message);

// Sets `field` of `message` from its text form (a flag's value), without
// logging; false when the text is not a value of the field's type.
bool ParseTextFieldValue(const std::string& text, const google::protobuf::FieldDescriptor* field,
                         google::protobuf::Message* message);

}  // namespace trident

#endif  // TRIDENT_BASE_TEXT_PROTO_H_
