#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "pipeline/pipeline.h"

namespace trident {
namespace {

bool IsCommunication(Op op) {
  return op != Op::kForward && op != Op::kBackward && op != Op::kBackwardInput && op != Op::kBackwardWeight &&
         op != Op::kRecompute;
}

const char* Colour(Op op) {
  switch (op) {
    case Op::kForward:
      return "#4e79a7";
    case Op::kBackward:
    case Op::kBackwardInput:
      return "#59a14f";
    case Op::kBackwardWeight:
      return "#b07aa1";
    case Op::kRecompute:
      return "#f28e2b";
    default:
      return "#9c9c9c";
  }
}

// "forward 3", or "forward 3 (chunk 1)" for a later model chunk.
std::string Name(const TimelineEvent& e) {
  return absl::StrCat(OpName(e.op), " ", e.micro_batch, e.chunk > 0 ? absl::StrCat(" (chunk ", e.chunk, ")") : "");
}

}  // namespace

std::string ChromeTraceJson(const std::vector<TimelineEvent>& events, const std::string& more_events) {
  std::string json = "{\"traceEvents\":[";
  for (size_t i = 0; i < events.size(); ++i) {
    const TimelineEvent& e = events[i];
    absl::StrAppend(&json, i == 0 ? "" : ",", "\n",
                    absl::StrFormat("{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":0,"
                                    "\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                                    "\"args\":{\"micro_batch\":%d,\"chunk\":%d}}",
                                    Name(e), OpName(e.op), e.stage, e.start * 1e6, (e.end - e.start) * 1e6,
                                    e.micro_batch, e.chunk));
  }
  if (!more_events.empty()) absl::StrAppend(&json, events.empty() ? "\n" : ",\n", more_events);
  absl::StrAppend(&json, "\n],\"displayTimeUnit\":\"ms\"}\n");
  return json;
}

std::string TimelineSvg(const std::vector<TimelineEvent>& events, const std::string& title) {
  int stages = 0;
  double end = 0;
  for (const TimelineEvent& e : events) {
    stages = std::max(stages, e.stage + 1);
    end = std::max(end, e.end);
  }
  const double width = 1000, row = 36, left = 70, top = 30;
  const double scale = end > 0 ? width / end : 1;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" "
      "fill=\"white\"/>\n<text x=\"4\" y=\"18\" font-size=\"13\">%s</text>\n",
      left + width + 10, top + stages * row + 30, title);
  for (int s = 0; s < stages; ++s) {
    absl::StrAppend(&svg,
                    absl::StrFormat("<text x=\"4\" y=\"%.0f\">stage %d</text>\n", top + s * row + row / 2 + 4, s));
  }
  for (const TimelineEvent& e : events) {
    const double x = left + e.start * scale, w = std::max(1.0, (e.end - e.start) * scale);
    const double y = top + e.stage * row;
    if (IsCommunication(e.op)) {
      absl::StrAppend(&svg, absl::StrFormat("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"4\" "
                                            "fill=\"%s\"><title>%s</title></rect>\n",
                                            x, y + row - 6, w, Colour(e.op), Name(e)));
      continue;
    }
    absl::StrAppend(
        &svg, absl::StrFormat("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.0f\" "
                              "fill=\"%s\" stroke=\"white\"><title>%s</title></rect>\n"
                              "<text x=\"%.1f\" y=\"%.1f\" fill=\"white\">%d</text>\n",
                              x, y + 2, w, row - 10, Colour(e.op), Name(e), x + 3, y + row / 2 + 2, e.micro_batch));
  }
  absl::StrAppend(&svg, absl::StrFormat("<text x=\"%.0f\" y=\"%.0f\" fill=\"#4e79a7\">forward</text>"
                                        "<text x=\"%.0f\" y=\"%.0f\" fill=\"#59a14f\">backward</text>"
                                        "<text x=\"%.0f\" y=\"%.0f\" fill=\"#b07aa1\">weight gradient</text>"
                                        "<text x=\"%.0f\" y=\"%.0f\" fill=\"#f28e2b\">recompute</text>"
                                        "<text x=\"%.0f\" y=\"%.0f\" fill=\"#9c9c9c\">communication</text>\n",
                                        left, top + stages * row + 18, left + 70, top + stages * row + 18, left + 150,
                                        top + stages * row + 18, left + 260, top + stages * row + 18, left + 340,
                                        top + stages * row + 18));
  return svg + "</svg>\n";
}

}  // namespace trident
