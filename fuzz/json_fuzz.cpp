// Fuzz target: JSON text through parse_json, the reader under manifests, safetensors headers,
// tokenizer.json and Hugging Face config.json. A value it accepts must write out (compact and
// indented) and read back equal.
#include <string>

#include "ckpt/json.h"
#include "fuzz/targets.h"

namespace mop {

void fuzz_json(std::string_view bytes) {
  const Json j = parse_json(bytes, "fuzz.json");
  for (int indent : {-1, 2}) {
    const std::string text = j.dump(indent);
    const Json again = accepted_again("the rewritten JSON",
                                      [&] { return parse_json(text, "fuzz.json (rewritten)"); });
    MOP_CHECK(again == j, "write → read changed the value: ", text);
  }
}

}  // namespace mop

MOP_FUZZ_MAIN(fuzz_json)
