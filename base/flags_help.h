// --help for Trident's binaries: the program's own flags, and the fields of a
// config message as flags, each with its type, default and the comment the
// .proto gives it. LibTorch's, glog's and gflags' own flags stay behind
// --helpfull.
//
//   int main(int argc, char** argv) {
//     gflags::SetUsageMessage("prepare_data --output_dir=DIR [--input=FILES]");
//     if (HelpRequested(argc, argv)) return PrintHelp(__FILE__);
//     gflags::ParseCommandLineFlags(&argc, &argv, true);
//     ...
#ifndef TRIDENT_BASE_FLAGS_HELP_H_
#define TRIDENT_BASE_FLAGS_HELP_H_

#include <cstddef>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace trident {

// Whether the command line asks for help: --help, -h or --helpshort
// (--helpfull is left to gflags, which lists every library's flags too).
bool HelpRequested(int argc, char** argv);

// The gflags defined in `defining_file` (a binary's __FILE__), one entry per
// flag: "  --name (type, default: value)" and its description on the next line.
std::string OwnFlagsHelp(absl::string_view defining_file);

// Prints the usage message (gflags::SetUsageMessage) and OwnFlagsHelp to
// standard output; returns 0, the exit code of a help request.
int PrintHelp(absl::string_view defining_file, const std::string& more = "");

// The fields of message `message_name` (full name, "trident.TrainerConfig") as
// flags, from `descriptor_set` (a serialized FileDescriptorSet written by
// protoc --include_source_info): each field's flag name, type, default and
// comments, its message fields by dotted name (--model_config.type, a map's
// entries as --model.args.KEY) under a heading of their own; an enum's type
// lists its values. Errors
// when the set does not parse or lacks the message.
// `extras`: the defaults a program applies over the message's own (fields
// set in `defaults`, a message of that type, show its values) and the other
// spellings of each flag by dotted name ("loop.lr" -> "--lr").
struct MessageHelpExtras {
  const google::protobuf::Message* defaults = nullptr;
  std::multimap<std::string, std::string> aliases;
};
absl::StatusOr<std::string> MessageFlagsHelp(const unsigned char* descriptor_set, size_t size,
                                             const std::string& message_name, const MessageHelpExtras& extras = {});

}  // namespace trident

#endif  // TRIDENT_BASE_FLAGS_HELP_H_
