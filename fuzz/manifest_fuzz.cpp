// Fuzz target: a checkpoint's manifest.json as read_manifest reads it (parse_json, then
// Manifest::from_json). A manifest it accepts must write out and read back to the same JSON.
#include <string>

#include "ckpt/manifest.h"
#include "fuzz/targets.h"

namespace mop {

void fuzz_manifest(std::string_view bytes) {
  const std::string where = "checkpoint fuzz: manifest.json";
  const Manifest m = Manifest::from_json(parse_json(bytes, where), where);
  const Json j = m.to_json();
  const std::string text = j.dump(2);
  const Manifest again = accepted_again("the rewritten manifest", [&] {
    return Manifest::from_json(parse_json(text, where), where);
  });
  MOP_CHECK(again.to_json() == j, "write → read changed the manifest: ", text);
}

}  // namespace mop

MOP_FUZZ_MAIN(fuzz_manifest)
