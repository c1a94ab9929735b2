import { useCallback, useEffect, useMemo, useState } from "react";
import {
  FluentProvider,
  Select,
  Tab,
  TabList,
  Title2,
  tokens,
  webLightTheme,
} from "@fluentui/react-components";
import { ApiClient } from "./api/client";
import { applySettingsUpdate, loadSettings, saveSettings, type Settings, type SettingsUpdate } from "./config/settings";
import { LanguageContext, useT } from "./i18n/I18nContext";
import { LANGUAGE_NAMES, LANGUAGES, type Language } from "./i18n/strings";
import { PasswordDialog, type PasswordRequest } from "./components/PasswordDialog";
import { StatusPanel } from "./components/StatusPanel";
import { ChatPage } from "./pages/ChatPage";
import { CompletionPage } from "./pages/CompletionPage";
import { ConfigsPage } from "./pages/ConfigsPage";
import { useServerStatus } from "./useServerStatus";

type Page = "configs" | "chat" | "completion";
const SAVE_DELAY_MS = 300;

/** The API lives on the server that serves this page, under the same path prefix. */
function apiBase(): string {
  return window.location.pathname.replace(/\/(index\.html)?$/, "");
}

export function App() {
  const [settings, setSettings] = useState<Settings>(() => loadSettings(window.localStorage, navigator.language));
  const [passwordRequest, setPasswordRequest] = useState<PasswordRequest | null>(null);
  const [page, setPage] = useState<Page>(() => pageFromHash());

  const client = useMemo(
    () =>
      new ApiClient(apiBase(), window.sessionStorage, (wrong) =>
        new Promise<string | null>((resolve) =>
          setPasswordRequest({
            wrong,
            answer: (password) => {
              setPasswordRequest(null);
              resolve(password);
            },
          }),
        ),
      ),
    [],
  );
  const server = useServerStatus(client);

  const update = useCallback((change: SettingsUpdate) => setSettings((current) => applySettingsUpdate(current, change)), []);
  useEffect(() => {
    const timer = setTimeout(() => saveSettings(window.localStorage, settings), SAVE_DELAY_MS);
    return () => clearTimeout(timer);
  }, [settings]);
  useEffect(() => {
    document.documentElement.lang = settings.language === "zh" ? "zh-CN" : settings.language;
  }, [settings.language]);
  useEffect(() => {
    window.location.hash = page;
  }, [page]);

  return (
    <LanguageContext.Provider value={settings.language}>
      <FluentProvider theme={webLightTheme} style={{ minHeight: "100vh", background: tokens.colorNeutralBackground2 }}>
        <Header page={page} onPage={setPage} language={settings.language} onLanguage={(language) => update({ language })} />
        <main style={{ display: "flex", gap: 16, padding: 16, alignItems: "flex-start" }}>
          <div style={{ flexGrow: 1, minWidth: 0 }}>
            {/* Pages stay mounted while hidden, so a running chat or batch survives a tab switch. */}
            <div hidden={page !== "configs"}>
              <ConfigsPage client={client} settings={settings} update={update} server={server} />
            </div>
            <div hidden={page !== "chat"}>
              <ChatPage client={client} settings={settings} update={update} />
            </div>
            <div hidden={page !== "completion"}>
              <CompletionPage client={client} settings={settings} update={update} />
            </div>
          </div>
          <StatusPanel server={server} />
        </main>
        <PasswordDialog request={passwordRequest} />
      </FluentProvider>
    </LanguageContext.Provider>
  );
}

function Header(props: { page: Page; onPage: (page: Page) => void; language: Language; onLanguage: (language: Language) => void }) {
  const t = useT();
  return (
    <header
      style={{
        display: "flex",
        alignItems: "center",
        gap: 24,
        padding: "8px 16px",
        background: tokens.colorNeutralBackground1,
        borderBottom: `1px solid ${tokens.colorNeutralStroke2}`,
      }}
    >
      <Title2>{t("appTitle")}</Title2>
      <TabList selectedValue={props.page} onTabSelect={(_, data) => props.onPage(data.value as Page)}>
        <Tab value="configs" data-testid="tab-configs">
          {t("tabConfigs")}
        </Tab>
        <Tab value="chat" data-testid="tab-chat">
          {t("tabChat")}
        </Tab>
        <Tab value="completion" data-testid="tab-completion">
          {t("tabCompletion")}
        </Tab>
      </TabList>
      <div style={{ marginLeft: "auto" }}>
        <Select
          aria-label={t("language")}
          value={props.language}
          onChange={(_, data) => props.onLanguage(data.value as Language)}
          data-testid="language-select"
        >
          {LANGUAGES.map((language) => (
            <option key={language} value={language}>
              {LANGUAGE_NAMES[language]}
            </option>
          ))}
        </Select>
      </div>
    </header>
  );
}

function pageFromHash(): Page {
  const hash = window.location.hash.replace("#", "");
  return hash === "chat" || hash === "completion" ? hash : "configs";
}
