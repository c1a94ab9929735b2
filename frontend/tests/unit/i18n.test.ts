import { describe, expect, it } from "vitest";
import { DICTIONARIES, LANGUAGES, translate } from "../../src/i18n/strings";

const placeholders = (text: string): string[] => [...text.matchAll(/\{(\w+)\}/g)].map((match) => match[1]!).sort();

describe("translations", () => {
  it("every language has every string, none empty", () => {
    const keys = Object.keys(DICTIONARIES.en).sort();
    for (const language of LANGUAGES) {
      expect(Object.keys(DICTIONARIES[language]).sort(), `keys of ${language}`).toEqual(keys);
      for (const [key, text] of Object.entries(DICTIONARIES[language])) {
        expect(text.trim(), `${language}.${key}`).not.toBe("");
      }
    }
  });

  it("every translation uses the same placeholders as the English text", () => {
    for (const language of LANGUAGES) {
      for (const [key, text] of Object.entries(DICTIONARIES[language])) {
        expect(placeholders(text), `${language}.${key}`).toEqual(placeholders(DICTIONARIES.en[key as keyof typeof DICTIONARIES.en]));
      }
    }
  });

  it("fills placeholders with the given values", () => {
    expect(translate("en", "usageLine", { prompt: 3, completion: 4, total: 7 })).toBe(
      "Last reply: 3 prompt + 4 completion = 7 tokens",
    );
    expect(translate("ja", "configsRangeHint", { min: 1, max: 8 })).toBe("整数、1-8");
  });
});
