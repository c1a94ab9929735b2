import { describe, expect, it } from "vitest";
import {
  applySettingsUpdate,
  defaultSettings,
  followServerDevice,
  languageFor,
  loadSettings,
  saveSettings,
  SETTINGS_KEY,
} from "../../src/config/settings";
import type { KeyValueStore } from "../../src/api/client";

function storeWith(value: string | null): KeyValueStore & { saved: string | null } {
  const store = {
    saved: value,
    getItem: () => store.saved,
    setItem: (_key: string, next: string) => void (store.saved = next),
    removeItem: () => void (store.saved = null),
  };
  return store;
}

describe("settings in localStorage", () => {
  it("round-trips everything the person set", () => {
    const store = storeWith(null);
    const settings = { ...defaultSettings("en-US"), device: "cuda" as const, workers: 4, batch: 960, modelPath: "/m/a.pth" };
    settings.chatSampling = { ...settings.chatSampling, temperature: 0.7, top_k: 20 };
    saveSettings(store, settings);
    expect(loadSettings(store, "en-US")).toEqual(settings);
  });

  it("replaces only the stored fields that are invalid", () => {
    const stored = { device: "tpu", workers: 99, batch: 64, language: "ja", chatSampling: { temperature: "hot", top_p: 0.9 } };
    const loaded = loadSettings(storeWith(JSON.stringify(stored)), "en");
    const defaults = defaultSettings("en");
    expect(loaded.device).toBe(defaults.device);
    expect(loaded.workers).toBe(defaults.workers);
    expect(loaded.batch).toBe(64);
    expect(loaded.language).toBe("ja");
    expect(loaded.chatSampling).toEqual({ ...defaults.chatSampling, top_p: 0.9 });
  });

  it("falls back to the defaults when the stored text is not JSON", () => {
    expect(loadSettings(storeWith("{not json"), "zh-CN")).toEqual(defaultSettings("zh-CN"));
  });

  it("saves under its own key", () => {
    const keys: string[] = [];
    saveSettings({ getItem: () => null, setItem: (key) => void keys.push(key), removeItem: () => undefined }, defaultSettings("en"));
    expect(keys).toEqual([SETTINGS_KEY]);
  });

  it("picks the browser's language when it is one of the three", () => {
    expect([languageFor("zh-CN"), languageFor("ja-JP"), languageFor("fr-FR"), languageFor("en")]).toEqual(["zh", "ja", "en", "en"]);
  });
});

describe("settings updates", () => {
  it("apply a patch, and keep the same object when nothing changes", () => {
    const current = defaultSettings("en-US");
    expect(applySettingsUpdate(current, { batch: 960 })).toEqual({ ...current, batch: 960 });
    expect(applySettingsUpdate(current, { batch: current.batch })).toBe(current);
    expect(applySettingsUpdate(current, () => ({}))).toBe(current);
  });

  it("follow the server's device until the person picks one, reading the pick when applied", () => {
    const untouched = { ...defaultSettings("en-US"), device: "albatross" as const, deviceChosen: false };
    expect(applySettingsUpdate(untouched, followServerDevice(false)).device).toBe("cpu");
    expect(applySettingsUpdate(untouched, followServerDevice(true)).device).toBe("albatross");
    // The status arrived before the pick, the change is applied after it: the pick stands.
    const follow = followServerDevice(false);
    const picked = applySettingsUpdate(untouched, { device: "albatross", deviceChosen: true });
    expect(applySettingsUpdate(picked, follow)).toBe(picked);
  });
});
