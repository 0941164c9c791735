#include "base/text_proto.h"

#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace trident {
namespace {

// Keeps the first text-format parse error instead of logging it.
class FirstError : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, int column, const std::string& message) override {
    if (text.empty()) text = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
  }
  std::string text;
};

}  // namespace

absl::StatusOr<std::string> ReadTextFile(const std::string& path, const std::string& what) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", what, " file ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::Status MergeTextProto(const std::string& text, const std::string& path, const std::string& what,
                            google::protobuf::Message* message) {
  FirstError error;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&error);
  if (!parser.MergeFromString(text, message)) {
    const google::protobuf::Descriptor* type = message->GetDescriptor();
    return absl::InvalidArgumentError(absl::StrCat(what, " file ", path, " is not a valid ", type->name(), " (",
                                                   error.text, "); the fields are in ", type->file()->name()));
  }
  return absl::OkStatus();
}

absl::Status ReadTextProto(const std::string& path, const std::string& what, google::protobuf::Message* message) {
  auto text = ReadTextFile(path, what);
  if (!text.ok()) return text.status();
  message->Clear();
  return MergeTextProto(*text, path, what, message);
}

bool ParseTextFieldValue(const std::string& text, const google::protobuf::FieldDescriptor* field,
                         google::protobuf::Message* message) {
  FirstError error;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&error);
  return parser.ParseFieldValueFromString(text, field, message);
}

absl::StatusOr<int> EnumValueNamed(const google::protobuf::EnumDescriptor* type, const std::string& field,
                                   const std::string& name) {
  const google::protobuf::EnumValueDescriptor* value = type->FindValueByName(absl::StrReplaceAll(name, {{"-", "_"}}));
  if (value != nullptr) return value->number();
  std::vector<std::string> names;
  for (int i = 0; i < type->value_count(); ++i) names.push_back(type->value(i)->name());
  return absl::InvalidArgumentError(
      absl::StrCat(field, "='", name, "' is unknown; choose ", absl::StrJoin(names, ", ")));
}

void OverlaySetFields(const google::protobuf::Message& from, google::protobuf::Message* to) {
  const google::protobuf::Reflection* reflection = from.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(from, &fields);  // the set singular fields and the non-empty lists
  std::unique_ptr<google::protobuf::Message> rest(from.New());
  rest->CopyFrom(from);  // what MergeFrom copies: scalars, enums and lists
  for (const google::protobuf::FieldDescriptor* field : fields) {
    if (field->is_repeated()) {
      to->GetReflection()->ClearField(to, field);  // the list replaces, MergeFrom would append
    } else if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
      OverlaySetFields(reflection->GetMessage(from, field), to->GetReflection()->MutableMessage(to, field));
      rest->GetReflection()->ClearField(rest.get(), field);
    }
  }
  to->MergeFrom(*rest);
}

}  // namespace trident
