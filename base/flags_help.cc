#include "base/flags_help.h"

#include <gflags/gflags.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>

#include <cstdio>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace trident {
namespace {

using google::protobuf::DescriptorProto;
using google::protobuf::FieldDescriptorProto;

// `text` as lines indented by `indent`, blank lines dropped.
std::string Indented(absl::string_view text, absl::string_view indent) {
  std::string out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (!line.empty()) absl::StrAppend(&out, indent, line, "\n");
  }
  return out;
}

std::string TypeName(const FieldDescriptorProto& field) {
  static const auto* names = new std::map<FieldDescriptorProto::Type, const char*>{
      {FieldDescriptorProto::TYPE_DOUBLE, "double"}, {FieldDescriptorProto::TYPE_FLOAT, "float"},
      {FieldDescriptorProto::TYPE_INT64, "int64"},   {FieldDescriptorProto::TYPE_UINT64, "uint64"},
      {FieldDescriptorProto::TYPE_INT32, "int32"},   {FieldDescriptorProto::TYPE_UINT32, "uint32"},
      {FieldDescriptorProto::TYPE_BOOL, "bool"},     {FieldDescriptorProto::TYPE_STRING, "string"},
      {FieldDescriptorProto::TYPE_ENUM, "enum"},     {FieldDescriptorProto::TYPE_MESSAGE, "message"}};
  auto name = names->find(field.type());
  const std::string type = name != names->end() ? name->second : "bytes";
  return field.label() == FieldDescriptorProto::LABEL_REPEATED ? absl::StrCat("list of ", type, ", one per flag")
                                                               : type;
}

// Every message of the descriptor set by full name, with its file and source
// path there (for comments).
struct MessageAt {
  const DescriptorProto* message;
  int file;
  std::vector<int> path;
};
using EnumIndex = std::map<std::string, const google::protobuf::EnumDescriptorProto*>;
void IndexMessages(const DescriptorProto& message, const std::string& scope, int file, std::vector<int> path,
                   std::map<std::string, MessageAt>* index, EnumIndex* enums) {
  const std::string name = absl::StrCat(scope, ".", message.name());
  (*index)[name] = {&message, file, path};
  for (const auto& type : message.enum_type()) (*enums)[absl::StrCat(name, ".", type.name())] = &type;
  for (int i = 0; i < message.nested_type_size(); ++i) {
    std::vector<int> nested = path;
    nested.insert(nested.end(), {DescriptorProto::kNestedTypeFieldNumber, i});
    IndexMessages(message.nested_type(i), name, file, nested, index, enums);
  }
}

// The value at dotted `path` of `message` when it is set there.
std::optional<std::string> SetValueAt(const google::protobuf::Message& message, const std::string& path) {
  const google::protobuf::Message* at = &message;
  std::vector<std::string> parts = absl::StrSplit(path, '.');
  for (size_t i = 0; i < parts.size(); ++i) {
    const google::protobuf::FieldDescriptor* field = at->GetDescriptor()->FindFieldByName(parts[i]);
    if (field == nullptr || field->is_repeated() || !at->GetReflection()->HasField(*at, field)) return std::nullopt;
    if (i + 1 == parts.size()) {
      std::string value;
      google::protobuf::TextFormat::PrintFieldValueToString(*at, field, -1, &value);
      return value;
    }
    if (field->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) return std::nullopt;
    at = &at->GetReflection()->GetMessage(*at, field);
  }
  return std::nullopt;
}

struct HelpWriter {
  MessageHelpExtras extras;
  std::map<std::string, MessageAt> messages;
  EnumIndex enums;
  std::map<std::pair<int, std::vector<int>>, std::string> comments;  // by file and source path
  std::string text;

  // "; alias --a, --b" for the other spellings of `path`, or "".
  std::string Aliases(const std::string& path) const {
    std::vector<std::string> names;
    for (auto [a, end] = extras.aliases.equal_range(path); a != end; ++a) names.push_back(a->second);
    return names.empty() ? "" : absl::StrCat("; alias ", absl::StrJoin(names, ", "));
  }
  // The same for every path under `prefix` (a map's keys).
  std::string AliasesUnder(const std::string& prefix) const {
    std::vector<std::string> names;
    for (auto a = extras.aliases.lower_bound(prefix); a != extras.aliases.end() && absl::StartsWith(a->first, prefix);
         ++a) {
      names.push_back(absl::StrCat(a->second, " for ", a->first.substr(prefix.size())));
    }
    return names.empty() ? "" : absl::StrCat("; aliases ", absl::StrJoin(names, ", "));
  }

  void Message(const MessageAt& at, const std::string& prefix, const std::string& heading) {
    absl::StrAppend(&text, heading, ":\n");
    std::vector<std::pair<const MessageAt*, std::string>> nested;  // listed after this message's fields
    for (int i = 0; i < at.message->field_size(); ++i) {
      const FieldDescriptorProto& field = at.message->field(i);
      std::vector<int> path = at.path;
      path.insert(path.end(), {DescriptorProto::kFieldFieldNumber, i});
      const std::string flag = absl::StrCat(prefix, field.name());
      auto type = messages.find(field.type_name());
      if (field.type() == FieldDescriptorProto::TYPE_MESSAGE && type != messages.end()) {
        if (type->second.message->options().map_entry()) {
          absl::StrAppend(&text, "  --", flag, ".KEY (string, one entry per flag", AliasesUnder(flag + "."), ")\n");
        } else {
          nested.emplace_back(&type->second, flag);
          absl::StrAppend(&text, "  --", flag, ".FIELD (", type->second.message->name(), ", below", Aliases(flag + "."),
                          ")\n");
        }
      } else {
        std::string value = field.has_default_value() ? field.default_value() : "unset";
        if (field.has_default_value() && field.type() == FieldDescriptorProto::TYPE_STRING) {
          value = absl::StrCat("\"", value, "\"");
        }
        if (extras.defaults != nullptr) value = SetValueAt(*extras.defaults, flag).value_or(value);
        std::string type = TypeName(field);
        if (auto values = enums.find(field.type_name()); values != enums.end()) {
          std::vector<std::string> names;
          for (const auto& v : values->second->value()) names.push_back(v.name());
          type = absl::StrCat(type, ": ", absl::StrJoin(names, "|"));
        }
        absl::StrAppend(&text, "  --", flag, " (", type,
                        field.label() == FieldDescriptorProto::LABEL_REPEATED ? "" : absl::StrCat(", default: ", value),
                        Aliases(flag), ")\n");
      }
      auto comment = comments.find({at.file, path});
      if (comment != comments.end()) absl::StrAppend(&text, Indented(comment->second, "      "));
    }
    for (const auto& [message, flag] : nested) {
      absl::StrAppend(&text, "\n");
      Message(*message, flag + ".", absl::StrCat("--", flag, ".FIELD (", message->message->name(), ")"));
    }
  }
};

}  // namespace

bool HelpRequested(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    if (arg == "--help" || arg == "-help" || arg == "-h" || arg == "--helpshort") return true;
  }
  return false;
}

std::string OwnFlagsHelp(absl::string_view defining_file) {
  std::vector<gflags::CommandLineFlagInfo> flags;
  gflags::GetAllFlags(&flags);
  std::string text;
  for (const gflags::CommandLineFlagInfo& flag : flags) {
    if (flag.filename != defining_file) continue;
    const std::string value = flag.type == "string" ? absl::StrCat("\"", flag.default_value, "\"") : flag.default_value;
    absl::StrAppend(&text, "  --", flag.name, " (", flag.type, ", default: ", value, ")\n",
                    Indented(flag.description, "      "));
  }
  return text;
}

int PrintHelp(absl::string_view defining_file, const std::string& more) {
  std::printf("%s\n\nFlags (--helpfull also lists the libraries' own):\n%s%s", gflags::ProgramUsage(),
              OwnFlagsHelp(defining_file).c_str(), more.empty() ? "" : absl::StrCat("\n", more).c_str());
  return 0;
}

absl::StatusOr<std::string> MessageFlagsHelp(const unsigned char* descriptor_set, size_t size,
                                             const std::string& message_name, const MessageHelpExtras& extras) {
  google::protobuf::FileDescriptorSet set;
  if (!set.ParseFromArray(descriptor_set, static_cast<int>(size))) {
    return absl::InternalError("the embedded descriptor set does not parse (a broken build)");
  }
  HelpWriter writer;  // messages of imported files (protoc --include_imports) are listed too
  writer.extras = extras;
  for (int f = 0; f < set.file_size(); ++f) {
    const google::protobuf::FileDescriptorProto& file = set.file(f);
    const std::string scope = file.package().empty() ? "" : "." + file.package();
    for (int i = 0; i < file.message_type_size(); ++i) {
      IndexMessages(file.message_type(i), scope, f, {google::protobuf::FileDescriptorProto::kMessageTypeFieldNumber, i},
                    &writer.messages, &writer.enums);
    }
    for (const auto& type : file.enum_type()) writer.enums[absl::StrCat(scope, ".", type.name())] = &type;
    for (const auto& location : file.source_code_info().location()) {
      std::string comment = location.leading_comments();
      if (!location.trailing_comments().empty()) absl::StrAppend(&comment, "\n", location.trailing_comments());
      if (!comment.empty()) writer.comments[{f, {location.path().begin(), location.path().end()}}] = comment;
    }
  }
  auto message = writer.messages.find("." + message_name);
  if (message != writer.messages.end()) {
    writer.Message(message->second, "",
                   absl::StrCat(message->second.message->name(), " (", set.file(message->second.file).name(), ")"));
    return writer.text;
  }
  return absl::NotFoundError(absl::StrCat("message ", message_name, " is not in the descriptor set"));
}

}  // namespace trident
