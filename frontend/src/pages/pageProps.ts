import type { ApiClient } from "../api/client";
import type { Settings, SettingsUpdate } from "../config/settings";

/** What every page receives from the app shell: the API client and the persisted settings. */
export interface PageProps {
  client: ApiClient;
  settings: Settings;
  update: (change: SettingsUpdate) => void;
}
