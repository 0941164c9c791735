// Text-format protobuf files (configs, strategies, LoRA configs), read with
// errors that name the file, the first bad line and the .proto with the fields.
#ifndef TRIDENT_BASE_TEXT_PROTO_H_
#define TRIDENT_BASE_TEXT_PROTO_H_

#include <string>
#include <vector>

#include <google/protobuf/generated_enum_reflection.h>
#include <google/protobuf/repeated_ptr_field.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace google::protobuf {
class EnumDescriptor;
class FieldDescriptor;
class Message;
}  // namespace google::protobuf

namespace trident {

// Fills `message` from the text file `path`. Errors: NotFound "cannot read
// <what> file <path>"; InvalidArgument "<what> file <path> is not a valid
// <Message> (line L column C: ...); the fields are in <its .proto>".
absl::Status ReadTextProto(const std::string& path, const std::string& what, google::protobuf::Message* message);

// The whole of text file `path`, or NotFound "cannot read <what> file <path>".
absl::StatusOr<std::string> ReadTextFile(const std::string& path, const std::string& what);
// Merges text-format `text` (read from `path`) into `message`, with
// ReadTextProto's errors.
absl::Status MergeTextProto(const std::string& text, const std::string& path, const std::string& what,
                            google::protobuf::Message* message);

// Sets `field` of `message` from its text form (a flag's value), without
// logging; false when the text is not a value of the field's type.
bool ParseTextFieldValue(const std::string& text, const google::protobuf::FieldDescriptor* field,
                         google::protobuf::Message* message);

// The number of the value named `name` in the enum `type` ('-' read as '_':
// per-token-mean names per_token_mean), or InvalidArgument
// "<field>='<name>' is unknown; choose <every name>".
absl::StatusOr<int> EnumValueNamed(const google::protobuf::EnumDescriptor* type, const std::string& field,
                                   const std::string& name);

// The same for a generated enum type: ParseEnum<RecomputeSpec::Method>("activation_checkpointing", "full").
template <typename Enum>
absl::StatusOr<Enum> ParseEnum(const std::string& field, const std::string& name) {
  absl::StatusOr<int> value = EnumValueNamed(google::protobuf::GetEnumDescriptor<Enum>(), field, name);
  if (!value.ok()) return value.status();
  return static_cast<Enum>(*value);
}

// Replaces the items of a repeated string field with `values`.
inline void SetStrings(google::protobuf::RepeatedPtrField<std::string>* field, const std::vector<std::string>& values) {
  field->Assign(values.begin(), values.end());
}

// Copies the fields set in `from` onto `to` (messages of the same type):
// singular sub-messages field by field, recursively; a non-empty repeated
// field replaces `to`'s whole list; scalars and enums overwrite.
void OverlaySetFields(const google::protobuf::Message& from, google::protobuf::Message* to);

// The items of a repeated field as a vector (for APIs that take one).
template <typename Repeated>
std::vector<typename Repeated::value_type> ToVector(const Repeated& field) {
  return {field.begin(), field.end()};
}

}  // namespace trident

#endif  // TRIDENT_BASE_TEXT_PROTO_H_
